"""CLIP score of an image and its prompt: 100 · max(cos(image embedding, text embedding), 0).

The standard definition (Hessel et al. 2021, as in torchmetrics' CLIPScore, with w = 100). The model is any CLIP
checkpoint loadable by `CLIPModel` + `CLIPProcessor` (e.g. `openai/clip-vit-large-patch14`, or a local folder);
prompts longer than the text model's positions (77 tokens for OpenAI CLIP) are truncated.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image


class CLIPScorer:
    def __init__(self, model: str, device: str | None = None, dtype: str | None = None):
        import torch
        from transformers import CLIPModel, CLIPProcessor

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype) if dtype else torch.float32
        if model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
            raise OSError(f"CLIP model folder {model} not found")
        try:
            self.processor = CLIPProcessor.from_pretrained(model)
            self.model = CLIPModel.from_pretrained(model, dtype=self.dtype)
        except (OSError, ValueError) as err:
            raise OSError(f"cannot load a CLIP model from {model!r} (CLIPModel + CLIPProcessor): "
                          f"{str(err).splitlines()[0]}") from err
        self.model.to(self.device).eval()
        self.max_length = self.model.config.text_config.max_position_embeddings

    def __call__(self, images: list[Image.Image], texts: list[str]) -> list[float]:
        """One score per (image, text) pair."""
        torch = self.torch
        if len(images) != len(texts):
            raise ValueError(f"got {len(images)} images and {len(texts)} texts")
        inputs = self.processor(text=texts, images=[im.convert("RGB") for im in images], return_tensors="pt",
                                padding=True, truncation=True, max_length=self.max_length)
        inputs = {k: v.to(self.device, self.dtype) if torch.is_floating_point(v) else v.to(self.device)
                  for k, v in inputs.items()}
        with torch.no_grad():
            out = self.model(**inputs)
        image = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)
        text = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
        cos = (image * text).sum(-1)
        return (100 * cos.clamp(min=0)).tolist()
