"""float16 where it breaks: a T5 text encoder (model.encoder_dtype=float16) is refused in one line naming the fix.
fp16 mixed precision (train.mixed_precision=fp16, with accelerate's GradScaler) is refused on the CPU and trained on a
GPU in tests/test_train_modes.py."""

from __future__ import annotations

import pytest

from imba.training.config import ConfigError, load_config


@pytest.mark.parametrize("encoder", ["auto", "tiny", "google/t5-v1_1-xxl"])
def test_a_t5_text_encoder_in_float16_is_refused_in_one_line_naming_bfloat16(encoder):
    with pytest.raises(ConfigError) as refused:
        load_config([f"model.text_encoder={encoder}", "model.encoder_dtype=float16"])
    message = str(refused.value)
    assert "\n" not in message and "T5" in message and "overflows" in message
    assert message.endswith("set model.encoder_dtype=bfloat16 (or float32)")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_fix_it_names_is_accepted(dtype):
    assert load_config([f"model.encoder_dtype={dtype}"]).model.encoder_dtype == dtype
