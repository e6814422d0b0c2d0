"""imba.eval: prompt sets, summary arithmetic, VQA success logic, and both runners on tiny random models, offline."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from imba.eval.prompts import (PromptFileError, attach_entries, category_from_filename, load_prompts,
                               parse_attribute_binding)
from imba.eval.run import EvalError, main, prepare_rows
from imba.eval.summary import bootstrap_mean_interval, markdown_table, summarize, wilson_interval
from imba.eval.vqa import answer_entry, questions_for

# ---- tiny models, built offline -----------------------------------------------------------------------------


def tiny_clip(folder):
    """A random 2-layer CLIP with a byte-level BPE tokenizer that has no merges (every byte is a token)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[ch + suffix] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), max_position_embeddings=24, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1, **layers),
        vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


VLM_WORDS = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "USER:", "ASSISTANT:", "yes", "no", "Yes", "No", "Is",
             "there", "a", "an", "in", "the", "image", "?", "Does", "show", "red", "car", "and", "blue", "bench",
             "Answer", "with", "or"]


def tiny_llava(folder):
    """A random LLaVA (tiny CLIP vision tower + 2-layer Llama) with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VLM_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Split("?", "isolated"),
                                                     pre_tokenizers.Split(".", "removed")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>",
                                        extra_special_tokens={"image_token": "<image>"})
    template = ("{% for m in messages %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
                "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %} ASSISTANT:{% endif %}")
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", chat_template=template,
                               image_token="<image>", num_additional_image_tokens=1)  # the CLS token
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=32, patch_size=8, **layers),
        text_config=LlamaConfig(vocab_size=len(VLM_WORDS), num_key_value_heads=2, max_position_embeddings=64,
                                pad_token_id=0, bos_token_id=2, eos_token_id=3, **layers),
        image_token_index=VLM_WORDS.index("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """A folder as imba.training.sample writes it: 4 images of 2 benchmark prompts + 1 image of a binding prompt."""
    folder = tmp_path_factory.mktemp("samples")
    (folder / "images").mkdir()
    rng = np.random.default_rng(0)
    entries = [
        {"prompt": "a photo of a zebra and a piano", "concepts": ["zebra", "piano"], "buckets": ["tail", "head"]},
        {"prompt": "a cat on top of a dog", "concepts": ["cat", "dog"], "buckets": ["head", "head"]},
    ]
    rows = []
    for i in range(4):
        p, j = divmod(i, 2)
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / "images" / f"{i:05d}.png")
        rows.append({"image": f"images/{i:05d}.png", "prompt_index": p, "sample_index": j, "seed": i,
                     "guidance_scale": 4.5, "steps": 2, "resolution": 32, **entries[p]})
    with open(folder / "manifest.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return folder


# ---- summary arithmetic -------------------------------------------------------------------------------------


def test_wilson_interval_matches_hand_computed_values():
    # 8/10: centre (0.8 + 1.96²/20) / (1 + 1.96²/10) = 0.71674, half 1.96·sqrt(0.016 + 0.0096037) / 1.38415 = 0.22658
    assert wilson_interval(8, 10) == pytest.approx((0.49016, 0.94332), abs=1e-5)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)  # 1.96²/10 / 1.38415
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    assert wilson_interval(50, 100) == pytest.approx((0.40383, 0.59617), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_bootstrap_interval_of_the_mean():
    values = [20.0, 22.0, 25.0, 27.0, 30.0, 31.0]
    lo, hi = bootstrap_mean_interval(values)
    assert lo < np.mean(values) < hi and 20 < lo and hi < 31
    assert bootstrap_mean_interval(values) == (lo, hi)  # seeded
    assert bootstrap_mean_interval([25.0] * 5) == (25.0, 25.0)
    wide = bootstrap_mean_interval([0.0, 50.0] * 3)
    assert wide[1] - wide[0] > hi - lo


def test_summary_groups_by_category_bucket_pair_and_rarest_bucket():
    rows = [
        {"prompt_index": 0, "success": True, "buckets": ["tail", "head"]},
        {"prompt_index": 0, "success": False, "buckets": ["tail", "head"]},
        {"prompt_index": 1, "success": True, "buckets": ["head", "head"]},
        {"prompt_index": 2, "success": False, "buckets": ["torso", "tail"]},
        {"prompt_index": 3, "success": True, "category": "color"},
        {"prompt_index": 4, "success": None},  # not evaluated: left out
    ]
    summary = {s["group"]: s for s in summarize(rows, "success")}
    assert list(summary) == ["all", "category: color", "buckets: head+head", "buckets: head+tail",
                             "buckets: torso+tail", "rarest: head", "rarest: tail"]
    assert (summary["all"]["n"], summary["all"]["successes"], summary["all"]["n_prompts"]) == (5, 3, 4)
    assert summary["all"]["value"] == pytest.approx(0.6)
    assert (summary["all"]["lo"], summary["all"]["hi"]) == wilson_interval(3, 5)
    assert (summary["buckets: head+tail"]["n"], summary["buckets: head+tail"]["successes"]) == (2, 1)
    assert (summary["rarest: tail"]["n"], summary["rarest: tail"]["successes"]) == (3, 1)
    assert summary["rarest: tail"]["n_prompts"] == 2
    assert summary["category: color"]["value"] == 1.0
    table = markdown_table(summarize(rows, "success"), "success")
    assert "| all | 5 | 4 | 0.600 (3/5) |" in table

    clip = summarize([{"clip_score": 20.0, "category": "a"}, {"clip_score": 30.0, "category": "b"}], "clip_score")
    assert [(s["group"], s["value"]) for s in clip] == [("all", 25.0), ("category: a", 20.0), ("category: b", 30.0)]


# ---- questions and success ----------------------------------------------------------------------------------


def test_success_means_every_answer_is_yes():
    image = Image.new("RGB", (8, 8))
    entry = {"prompt": "an apple on top of a unicorn", "concepts": ["apple", "unicorn"]}
    assert [q["question"] for q in questions_for(entry)] == [
        "Is there an apple in the image?", "Is there a unicorn in the image?"]
    asked = []

    def fake(p_by_question):
        def p_yes(img, question):
            assert img is image
            asked.append(question)
            return p_by_question[question]
        return p_yes

    answers = {"Is there an apple in the image?": 0.9, "Is there a unicorn in the image?": 0.5,
               "Does the image show an apple on top of a unicorn?": 0.2}
    result = answer_entry(entry, image, fake(answers))
    assert result["success"] is True  # 0.5 meets the threshold
    assert [q["p_yes"] for q in result["questions"]] == [0.9, 0.5] and len(asked) == 2
    assert answer_entry(entry, image, fake(answers), threshold=0.6)["success"] is False
    # a relation (or --ask-prompt) adds the whole-prompt question, which must be yes too
    with_relation = answer_entry({**entry, "relation": "on top of"}, image, fake(answers))
    assert with_relation["questions"][-1] == {"kind": "prompt", "question": "Does the image show an apple on top "
                                              "of a unicorn?", "p_yes": 0.2, "yes": False}
    assert with_relation["success"] is False
    assert answer_entry(entry, image, fake(answers), ask_prompt=True)["success"] is False
    with pytest.raises(ValueError, match="probability"):
        answer_entry(entry, image, lambda img, q: 1.5)
    with pytest.raises(ValueError, match="no concepts"):
        questions_for({"prompt": "x", "concepts": []})


# ---- prompt sets --------------------------------------------------------------------------------------------


def test_loads_the_inert_concept_benchmark_as_written_by_data_concepts(tmp_path):
    from data.prep.benchmark import build_benchmark

    stats = {"concepts": [{"concept": c, "count": n, "bucket": b} for c, n, b in [
        ("dog", 500, "head"), ("cat", 300, "head"), ("kite", 40, "torso"), ("anvil", 5, "tail"),
        ("zebra", 2, "tail")]], "pairs": []}  # no pair seen together in a caption
    bench = build_benchmark(stats, per_bin=2, num_pairs=4, captions_per_pair=2, num_bins=3)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    entries = load_prompts(path)
    assert entries == bench  # kept as is: prompt, concepts, counts, buckets, bins, template
    assert all(len(e["concepts"]) == 2 and e["concepts"][0] in e["prompt"] for e in entries)


def test_loads_lc_mis_style_pairs(tmp_path):
    path = tmp_path / "lcmis.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "a zebra playing a piano", "concept_a": "zebra", "concept_b": "a piano", "relation": "playing"},
        {"prompt": "a cow and a bicycle", "object1": "cow", "object2": "bicycle", "category": "rare"},
        {"prompt": "a lamp and a whale", "concepts": ["lamp", "whale"]},
        {"prompt": "a fox and an owl"},
    ]))
    entries = load_prompts(path)
    assert [e["concepts"] for e in entries] == [["zebra", "piano"], ["cow", "bicycle"], ["lamp", "whale"],
                                               ["fox", "owl"]]
    assert entries[0]["relation"] == "playing" and entries[1]["category"] == "rare"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "x", "concepts": "not a list"}]))
    with pytest.raises(PromptFileError, match="list of non-empty strings"):
        load_prompts(bad)
    with pytest.raises(PromptFileError, match="not found"):
        load_prompts(tmp_path / "missing.json")


def test_parses_t2i_compbench_attribute_binding_files(tmp_path):
    assert category_from_filename("color_val.txt") == "color"
    assert category_from_filename("texture_train.txt") == "texture"
    assert category_from_filename("spatial_val.txt") is None
    assert parse_attribute_binding("a red car and a blue bench", "color") == [("red", "car"), ("blue", "bench")]
    assert parse_attribute_binding("A light blue fire hydrant and an orange cat.", "color") == [
        ("light blue", "fire hydrant"), ("orange", "cat")]
    assert parse_attribute_binding("a wooden table, a metallic car and a fluffy dog", "texture") == [
        ("wooden", "table"), ("metallic", "car"), ("fluffy", "dog")]
    path = tmp_path / "shape_val.txt"
    path.write_text("an oval mirror and a rectangular sink\n\n")
    (entry,) = load_prompts(path)
    assert entry == {"prompt": "an oval mirror and a rectangular sink", "category": "shape",
                     "pairs": [["oval", "mirror"], ["rectangular", "sink"]],
                     "concepts": ["oval mirror", "rectangular sink"]}
    assert [q["question"] for q in questions_for(entry)] == [
        "Is there an oval mirror in the image?", "Is there a rectangular sink in the image?"]
    other = tmp_path / "prompts.txt"
    other.write_text("a cat and a dog\n")
    assert load_prompts(other) == [{"prompt": "a cat and a dog", "concepts": ["cat", "dog"]}]
    assert load_prompts(other, category="colour")[0]["pairs"] == [["", "cat"], ["", "dog"]]


def test_joins_prompt_entries_onto_manifest_rows():
    entries = [{"prompt": "p0", "concepts": ["a", "b"], "buckets": ["head", "tail"]},
               {"prompt": "p1", "concepts": ["c", "d"]}]
    rows = [{"image": "images/0.png", "prompt": "p1", "prompt_index": 1, "seed": 5},
            {"image": "images/1.png", "prompt": "p0", "prompt_index": 7}]  # index out of range: joined by text
    joined = attach_entries(rows, entries)
    assert joined[0] == {"prompt": "p1", "concepts": ["c", "d"], "image": "images/0.png", "prompt_index": 1,
                         "seed": 5}
    assert joined[1]["buckets"] == ["head", "tail"]
    with pytest.raises(PromptFileError, match="'p9' of images/2.png is not in the prompt file"):
        attach_entries([{"image": "images/2.png", "prompt": "p9"}], entries)


# ---- runners end to end on tiny random models ---------------------------------------------------------------


def test_clip_runner_end_to_end(samples, tmp_path, capsys):
    from imba.eval.clip_score import CLIPScorer

    model = tiny_clip(tmp_path / "clip")
    out = tmp_path / "eval" / "clip.jsonl"
    assert main(["clip", "--images", str(samples), "--model", str(model), "--out", str(out),
                 "--batch-size", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["image"] for r in rows] == [f"images/{i:05d}.png" for i in range(4)]
    assert all(r["buckets"] and 0 <= r["clip_score"] <= 100 for r in rows)

    # the score is 100 · max(cos, 0): flipping the text projection flips the cosine
    scorer = CLIPScorer(str(model))
    images = [Image.open(samples / r["image"]) for r in rows]
    texts = [r["prompt"] for r in rows]
    assert scorer(images, texts) == pytest.approx([r["clip_score"] for r in rows], abs=1e-4)
    inputs = scorer.processor(text=texts, images=images, return_tensors="pt", padding=True, truncation=True,
                              max_length=24)  # the tiny text model's positions: long prompts are cut
    with torch.no_grad():
        out_model = scorer.model(**inputs)
    cos = torch.nn.functional.cosine_similarity(out_model.image_embeds, out_model.text_embeds).tolist()
    assert [r["clip_score"] for r in rows] == pytest.approx([100 * max(c, 0) for c in cos], abs=1e-4)
    with torch.no_grad():
        scorer.model.text_projection.weight.neg_()
    flipped = scorer(images, texts)
    assert [a + b for a, b in zip(flipped, (r["clip_score"] for r in rows))] == pytest.approx(
        [100 * abs(c) for c in cos], abs=1e-4)
    assert min(cos) != max(cos)

    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert [s["group"] for s in summary] == ["all", "buckets: head+head", "buckets: head+tail", "rarest: head",
                                             "rarest: tail"]
    assert summary[0]["n"] == 4 and summary[0]["value"] == pytest.approx(np.mean([r["clip_score"] for r in rows]))
    assert "| all | 4 | 2 |" in out.with_suffix(".md").read_text()
    assert "| all | 4 | 2 |" in capsys.readouterr().out


def test_vqa_runner_end_to_end(samples, tmp_path, capsys):
    from imba.eval.vqa import HFYesNoVQA

    model = tiny_llava(tmp_path / "llava")
    out = tmp_path / "vqa.jsonl"
    assert main(["vqa", "--images", str(samples), "--model", str(model), "--out", str(out), "--ask-prompt"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert [q["question"] for q in row["questions"]] == [
            f"Is there a {row['concepts'][0]} in the image?", f"Is there a {row['concepts'][1]} in the image?",
            f"Does the image show {row['prompt']}?"]
        assert all(0 < q["p_yes"] < 1 and q["yes"] == (q["p_yes"] >= 0.5) for q in row["questions"])
        assert row["success"] == all(q["yes"] for q in row["questions"])
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    k = sum(r["success"] for r in rows)
    assert summary[0] == {"group": "all", "n": 4, "n_prompts": 2, "successes": k, "value": k / 4,
                          "lo": pytest.approx(wilson_interval(k, 4)[0]), "hi": pytest.approx(wilson_interval(k, 4)[1])}
    main(["vqa", "--images", str(samples), "--model", str(model), "--out", str(out), "--threshold", "0"])
    assert all(json.loads(line)["success"] for line in out.read_text().splitlines())
    assert "| all | 4 | 2 | 1.000 (4/4) |" in capsys.readouterr().out

    # p_yes compares the answers' next-token logits: equal yes/no rows give 1/2, swapped rows give 1 − p
    vqa = HFYesNoVQA(str(model))
    assert vqa.yes_ids == [VLM_WORDS.index("yes"), VLM_WORDS.index("Yes")]
    assert vqa.no_ids == [VLM_WORDS.index("no"), VLM_WORDS.index("No")]
    image, question = Image.open(samples / "images" / "00000.png"), "Is there a red car in the image?"
    p = vqa(image, question)
    head = vqa.model.lm_head.weight if hasattr(vqa.model, "lm_head") else vqa.model.get_output_embeddings().weight
    with torch.no_grad():
        original = head.clone()
        head[vqa.yes_ids], head[vqa.no_ids] = original[vqa.no_ids], original[vqa.yes_ids]
        assert vqa(image, question) == pytest.approx(1 - p, abs=1e-6)
        head[vqa.yes_ids] = head[vqa.no_ids]
        assert vqa(image, question) == pytest.approx(0.5, abs=1e-6)
    assert p != pytest.approx(0.5, abs=1e-4)


def test_runner_needs_a_manifest_and_skips_missing_images(samples, tmp_path, capsys):
    with pytest.raises(EvalError, match="no manifest.jsonl in .*written by python -m imba.training.sample"):
        prepare_rows(tmp_path)
    # a copy of the samples with one image gone: evaluated on the rest, the gap reported
    copy = tmp_path / "copy"
    (copy / "images").mkdir(parents=True)
    (copy / "manifest.jsonl").write_text((samples / "manifest.jsonl").read_text())
    for i in (0, 1, 3):
        name = f"images/{i:05d}.png"
        (copy / name).write_bytes((samples / name).read_bytes())
    from imba.eval.run import run_vqa

    skipped = {}
    results = run_vqa(prepare_rows(copy, need_concepts=True), copy, lambda img, q: 1.0, skipped=skipped)
    assert [r["image"] for r in results] == ["images/00000.png", "images/00001.png", "images/00003.png"]
    assert skipped == {"missing image": 1} and all(r["success"] for r in results)
    assert math.isclose(summarize(results, "success")[0]["value"], 1.0)
