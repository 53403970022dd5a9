"""The numerics policy: pure data, parsed from YAML with bad keys named."""

import subprocess
import sys

import pytest

from h2jax.plan._numerics import NumericsError, NumericsPolicy, parse_numerics


def test_default_is_exact_and_parses_from_nothing():
    assert NumericsPolicy().is_exact
    assert parse_numerics(None) == NumericsPolicy()
    assert parse_numerics({}) == NumericsPolicy()


def test_parse_a_bf16_chip():
    p = parse_numerics({"matmul_precision": "default", "matmul_input_rounding": "bf16"})
    assert (p.matmul_precision, p.mantissa_bits, p.is_exact) == ("default", 7, False)
    assert parse_numerics({"matmul_input_rounding": "tf32"}).mantissa_bits == 10
    assert parse_numerics({"compute_dtype": "bfloat16"}).compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("raw", "key", "words"),
    [
        ({"matmul_precison": "high"}, "cluster.chips.x.numerics.matmul_precison", "unknown key"),
        ({"matmul_precision": "fp32"}, "cluster.chips.x.numerics.matmul_precision", "default | high | highest"),
        ({"matmul_input_rounding": 7}, "cluster.chips.x.numerics.matmul_input_rounding", "expected a string"),
        ({"compute_dtype": "int8"}, "cluster.chips.x.numerics.compute_dtype", "float32 | bfloat16 | float16"),
        ("bf16", "cluster.chips.x.numerics", "expected a mapping"),
    ],
)
def test_bad_keys_and_values_are_named(raw, key, words):
    with pytest.raises(NumericsError) as info:
        parse_numerics(raw, key="cluster.chips.x.numerics")
    assert info.value.key == key
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_the_policy_module_never_imports_jax():
    code = "import sys, h2jax.plan._numerics as n; n.parse_numerics({'matmul_input_rounding': 'bf16'}); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
