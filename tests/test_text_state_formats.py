"""The stored T5 state formats at their edges: the int8 scale is each token's own largest magnitude / 127 (its
largest value stored as ±127 exactly), one token and an all-zero token, the arrays' shapes and dtypes checked
exactly, memory shared where the docstrings say so and copied where they say a new tensor."""

import numpy as np
import pytest
import torch

from data.text_states import (
    STORED_NUMPY_DTYPE,
    STORED_TORCH_DTYPE,
    bytes_per_token,
    check_stored,
    dequantize,
    encode_states,
    states_from_numpy,
    stored_tensor,
)


def test_int8_scale_is_each_tokens_largest_magnitude_over_127():
    states = torch.tensor([[0.5, -2.54, 1.0], [3.0, 0.0, -0.3], [0.0, 0.0, 0.0], [-1e-3, 2e-3, 0.0]])
    values, scale = encode_states(states, "int8")
    assert np.array_equal(scale, np.array([2.54, 3.0, 0.0, 2e-3], np.float32) / np.float32(127))
    # each token's largest magnitude is stored as ±127 exactly, with its sign; a zero token as zeros
    assert values[0, 1] == -127 and values[1, 0] == 127 and values[3, 1] == 127
    assert values[2].tolist() == [0, 0, 0]
    # rounding, not truncation: 0.5 / (2.54 / 127) = 25.0, 1.0 / 0.02 = 50.0, -0.3 / (3 / 127) = -12.7 -> -13
    assert values[0].tolist() == [25, -127, 50] and values[1].tolist() == [127, 0, -13]
    assert values[3].tolist() == [-64, 127, 0]  # -63.5 rounds half to even: -64


def test_the_only_token_round_trips_within_half_a_step():
    states = torch.tensor([[1.0, -0.25, 0.126]])
    values, scale = encode_states(states, "int8")
    back = states_from_numpy(values, scale, "int8")
    assert back.shape == (1, 3) and back.dtype == torch.float32
    assert float(back[0, 0]) == pytest.approx(1.0, rel=1e-6)  # the largest value is exact (127 · s)
    assert ((back - states).abs() <= float(scale[0]) / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("text_dtype", ["float16", "bfloat16", "int8"])
def test_encode_accepts_any_float_dtype_and_device_tensor_with_grad(text_dtype):
    states = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    values, scale = encode_states(states, text_dtype)
    assert values.dtype == STORED_NUMPY_DTYPE[text_dtype] and values.shape == (3, 5)
    assert (scale is None) == (text_dtype != "int8")
    check_stored(values, scale, text_dtype)
    back = states_from_numpy(values, scale, text_dtype, dtype=torch.float64)
    assert back.dtype == torch.float64
    step = {"float16": 2 ** -10, "bfloat16": 2 ** -7, "int8": 1 / 127}[text_dtype]
    assert ((back - states.detach()).abs() <= states.detach().abs().amax() * step).all()


def test_bfloat16_is_stored_as_its_bit_patterns():
    states = torch.tensor([[1.0, -2.0, 0.5]])
    values, _ = encode_states(states, "bfloat16")
    assert values.tolist() == [[0x3F80, 0xC000, 0x3F00]]  # bfloat16 1.0, -2.0, 0.5
    assert torch.equal(stored_tensor(values, "bfloat16").float(), states)


@pytest.mark.parametrize("values,scale,text_dtype", [
    (np.zeros(4, np.float16), None, "float16"),  # one dimension
    (np.zeros((1, 2, 4), np.float16), None, "float16"),  # three
    (np.zeros((2, 4), np.float32), None, "float16"),  # float32 is no stored dtype
    (np.zeros((2, 4), np.int16), None, "bfloat16"),  # signed 16 bits are not the bfloat16 marker
    (np.zeros((2, 4), np.uint8), np.ones(2, np.float32), "int8"),
    (np.zeros((2, 4), np.int8), np.ones(2, np.float64), "int8"),  # the scale is float32
    (np.zeros((2, 4), np.int8), np.ones((2, 1), np.float32), "int8"),  # (n,), not (n, 1)
    (np.zeros((2, 4), np.int8), np.ones(3, np.float32), "int8"),
    (np.zeros((2, 4), np.uint16), np.ones(2, np.float32), "bfloat16"),  # a scale where none belongs
])
def test_check_stored_refuses_every_other_layout(values, scale, text_dtype):
    with pytest.raises(ValueError):
        check_stored(values, scale, text_dtype)
    with pytest.raises(ValueError):
        states_from_numpy(values, scale, text_dtype)


def test_check_stored_accepts_the_exact_layouts_including_one_token():
    for text_dtype in ("float16", "bfloat16"):
        check_stored(np.zeros((1, 4), STORED_NUMPY_DTYPE[text_dtype]), None, text_dtype)
    check_stored(np.zeros((1, 4), np.int8), np.ones(1, np.float32), "int8")


def test_stored_tensor_shares_memory_and_states_from_numpy_copies():
    for text_dtype in ("float16", "bfloat16", "int8"):
        values = np.ones((2, 3), STORED_NUMPY_DTYPE[text_dtype])
        tensor = stored_tensor(values, text_dtype)
        assert tensor.dtype == STORED_TORCH_DTYPE[text_dtype] and tensor.shape == (2, 3)
        assert tensor.data_ptr() == values.ctypes.data  # a view: no copy on the reader's hot path
    half = np.full((2, 3), 1.5, np.float16)
    out = states_from_numpy(half, None, "float16", dtype=torch.float16)  # already the wanted dtype
    out.fill_(9)
    assert (half == np.float16(1.5)).all()  # "a new tensor": the stored array is left as it was


def test_dequantize_scales_each_token_by_its_own_scale():
    stored = torch.tensor([[1, -2], [3, 4], [127, 0]], dtype=torch.int8)
    scale = torch.tensor([0.5, 2.0, 0.25])
    out = dequantize(stored, scale, torch.float64)
    assert out.dtype == torch.float64 and out.tolist() == [[0.5, -1.0], [6.0, 8.0], [31.75, 0.0]]
    assert stored.tolist() == [[1, -2], [3, 4], [127, 0]]  # the stored tensor is not changed
    floats = torch.randn(2, 3)
    assert dequantize(floats, None, torch.float32) is floats  # unscaled and already the dtype: no copy


def test_bytes_per_token_of_each_format():
    assert bytes_per_token("float16", 10) == 20 and bytes_per_token("bfloat16", 10) == 20
    assert bytes_per_token("int8", 10) == 14 and bytes_per_token("int8", 1) == 5
    with pytest.raises(ValueError, match="text_dtype must be one of"):
        bytes_per_token("float32", 10)


def test_a_refused_scale_is_described_in_the_message():
    values = np.zeros((3, 4), np.int8)
    with pytest.raises(ValueError, match=r"needs a float32 scale per token \(3,\), found none$"):
        check_stored(values, None, "int8")
    with pytest.raises(ValueError, match=r"per token \(3,\), found float64 \(3,\)$"):
        check_stored(values, np.ones(3, np.float64), "int8")
