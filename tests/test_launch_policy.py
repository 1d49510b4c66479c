"""The launch policy's lookup and the environment's overrides of it (GOVERNOR_LAUNCH_POLICY), which A/B measurements
of whole engines use: every process of an engine, tensor-parallel workers included, looks its policy up so."""

from __future__ import annotations

import pytest
import torch

from governor.kernels import launch_policy
from governor.kernels.launch_policy import POLICY_ENV, GemvConfig, LaunchPolicy, policy_for, with_overrides


def test_the_environment_sets_fields_of_every_looked_up_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, '{"decode_rotary": false, "reduce_norm_packet_max_rows": 0, '
                                   '"gemv": [8, 1024, 4], "packed_gemm_tiles": [[8, [64, 512, 4]]]}')
    policy_for.cache_clear()
    try:
        policy = policy_for(torch.device("cpu"))
    finally:
        monkeypatch.delenv(POLICY_ENV)
        policy_for.cache_clear()
    assert not policy.decode_rotary and policy.reduce_norm_packet_max_rows == 0
    assert policy.gemv == GemvConfig(8, 1024, 4) and isinstance(policy.gemv, GemvConfig)
    assert policy.packed_gemm_tiles == ((8, (64, 512, 4)),)
    assert policy.tile_n == LaunchPolicy().tile_n  # the rest as the architecture's
    assert policy_for(torch.device("cpu")) == launch_policy.POLICIES["default"]  # unset: none


@pytest.mark.parametrize(("text", "match"), [("{not json", "JSON object"), ("[1, 2]", "JSON object"),
                                             ('{"decode_rotory": false}', "unknown: decode_rotory")])
def test_a_bad_override_names_the_fields(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        with_overrides(LaunchPolicy(), text)
    assert "decode_rotary" in str(err.value)  # the fields it takes are listed


@pytest.mark.parametrize("text", ['{"decode_rotary": "false"}', '{"tile_n": true}', '{"tile_n": 1.5}',
                                  '{"step_pdl": null}'])
def test_an_override_of_the_wrong_type_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="takes a value like"):
        with_overrides(LaunchPolicy(), text)


def test_an_override_may_clear_an_optional_field_and_give_a_float_an_int() -> None:
    policy = with_overrides(LaunchPolicy(), '{"decode_maxnreg_fp8": null, "decode_wide_min_wave_fill": 1}')
    assert policy.decode_maxnreg_fp8 is None and policy.decode_wide_min_wave_fill == 1
