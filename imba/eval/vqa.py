"""VQA success: ask a vision-language model yes/no questions about each generated image.

Per entry with concepts A, B, ...: "Is there a A in the image?" for each concept, and, when the entry has a
"relation" (or `ask_prompt=True`), "Does the image show <prompt>?". Success = every answer is yes (p_yes ≥
threshold, 0.5 by default). The model is any callable `(image, question) -> p_yes` (`PYes`), so another VLM, an
API or a test double plugs in; `HFYesNoVQA` wraps a transformers image-text-to-text model.

How `HFYesNoVQA` scores: one forward pass per question, no generation: p_yes = softmax over the two answers of
the next-token logits, each answer's logit being the log-sum-exp over its single-token spellings ("yes", "Yes",
" yes", ...; "no" likewise), so no parsing of generated text is involved. The question goes through the processor's
chat template when it has one (LLaVA-1.5-hf, Qwen2/2.5-VL, SmolVLM, Idefics, ...: `prompt_template` formats the text
part), else "Question: ... Answer:" with the processor's image token in front when it has one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from data.text import with_article

PYes = Callable[[Image.Image, str], float]


def questions_for(entry: dict[str, Any], ask_prompt: bool = False) -> list[dict[str, str]]:
    """[{"kind": "concept" | "prompt", "question": ...}] for one prompt entry."""
    concepts = entry.get("concepts") or []
    if not concepts:
        raise ValueError(f"no concepts to ask about for prompt {entry.get('prompt')!r}")
    questions = [{"kind": "concept", "concept": c, "question": f"Is there {with_article(c)} in the image?"}
                 for c in concepts]
    if ask_prompt or entry.get("relation"):
        questions.append({"kind": "prompt", "question": f"Does the image show {entry['prompt'].strip().rstrip('.')}?"})
    return questions


def answer_entry(entry: dict[str, Any], image: Image.Image, p_yes: PYes, threshold: float = 0.5,
                 ask_prompt: bool = False) -> dict[str, Any]:
    """{"questions": [{..., "p_yes", "yes"}], "success": all yes} for one image of one entry."""
    answered = []
    for q in questions_for(entry, ask_prompt):
        p = float(p_yes(image, q["question"]))
        if not 0.0 <= p <= 1.0 or math.isnan(p):
            raise ValueError(f"p_yes must be a probability in [0, 1], got {p} for {q['question']!r}")
        answered.append({**q, "p_yes": p, "yes": p >= threshold})
    return {"questions": answered, "success": all(q["yes"] for q in answered)}


def _answer_token_ids(tokenizer, word: str) -> set[int]:
    """Ids of the single-token spellings of `word` in this tokenizer (first token of each spelling, when it decodes
    to the word or a prefix of it; the unknown token never counts)."""
    ids = set()
    for spelling in (word, word.capitalize(), word.upper(), " " + word, " " + word.capitalize()):
        tokens = tokenizer.encode(spelling, add_special_tokens=False)
        if not tokens or tokens[0] == tokenizer.unk_token_id:
            continue
        text = tokenizer.decode(tokens[:1]).strip().lower()
        if text and word.startswith(text):
            ids.add(tokens[0])
    return ids


class HFYesNoVQA:
    """A transformers vision-language model as a `(image, question) -> p_yes` callable.

    `model`: hub id or local folder loadable by `AutoProcessor` + `AutoModelForImageTextToText`.
    `prompt_template`: the text sent for a question (`{question}` is replaced).
    """

    def __init__(self, model: str, device: str | None = None, dtype: str | None = None,
                 prompt_template: str = "{question} Answer with yes or no.", trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device.startswith("cuda")
                                                          else torch.float32)
        if model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
            raise OSError(f"vision-language model folder {model} not found")
        try:
            self.processor = AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
            self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=self.dtype,
                                                                     trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise OSError(f"cannot load a vision-language model from {model!r} (AutoProcessor + "
                          f"AutoModelForImageTextToText): {str(err).splitlines()[0]}") from err
        self.model.to(self.device).eval()
        self.prompt_template = prompt_template
        self.tokenizer = getattr(self.processor, "tokenizer", None) or self.processor
        self.yes_ids = sorted(_answer_token_ids(self.tokenizer, "yes"))
        self.no_ids = sorted(_answer_token_ids(self.tokenizer, "no"))
        if not self.yes_ids or not self.no_ids or set(self.yes_ids) & set(self.no_ids):
            raise ValueError(f"the tokenizer of {model!r} has no distinct single tokens for 'yes' and 'no'")

    def prompt(self, question: str) -> str:
        text = self.prompt_template.format(question=question)
        if getattr(self.processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = f"Question: {text} Answer:"
        image_token = getattr(self.processor, "image_token", None)
        return f"{image_token}\n{prompt}" if isinstance(image_token, str) and image_token else prompt

    def __call__(self, image: Image.Image, question: str) -> float:
        torch = self.torch
        inputs = self.processor(images=[image.convert("RGB")], text=[self.prompt(question)], return_tensors="pt")
        inputs = {k: (v.to(self.device, self.dtype) if torch.is_floating_point(v) else v.to(self.device))
                  if torch.is_tensor(v) else v for k, v in inputs.items()}
        ids = inputs.get("input_ids")
        # the next token must follow the prompt, not an end-of-sequence token a tokenizer appends (BERT, T5)
        ends = {self.tokenizer.eos_token_id, getattr(self.tokenizer, "sep_token_id", None)} - {None}
        if ids is not None and ids.shape[1] > 1 and int(ids[0, -1]) in ends:
            for key in ("input_ids", "attention_mask"):
                if key in inputs:
                    inputs[key] = inputs[key][:, :-1]
        extra = {}
        if getattr(self.model.config, "is_encoder_decoder", False):
            start = getattr(self.model.generation_config, "decoder_start_token_id", None)
            if start is None:
                start = getattr(self.model.config, "decoder_start_token_id", None)
            if start is None:
                raise ValueError("this encoder-decoder model names no decoder_start_token_id")
            extra["decoder_input_ids"] = torch.tensor([[start]], device=self.device)
        with torch.no_grad():
            logits = self.model(**inputs, **extra).logits[0, -1].float()
        yes = torch.logsumexp(logits[self.yes_ids], 0)
        no = torch.logsumexp(logits[self.no_ids], 0)
        return float(torch.sigmoid(yes - no))
