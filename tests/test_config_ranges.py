"""Every config field holds a value its users can: out-of-range numbers, huge ints, bad strings and
bombs get a ConfigError naming the field and the rule (never an OverflowError in a worker), and the
message carries only the start of the value."""

import pytest

from cluster.config import ConfigError, EngineConfig, config_from_dict, load_config


@pytest.mark.parametrize(
    "data,message",
    [
        ({"parallel": {"step_timeout_s": 1e300}}, "parallel.step_timeout_s=1e+300: must be finite, in [-1e+15, 1e+15]"),
        (
            {"parallel": {"step_timeout_s": 1e9}},
            "parallel.step_timeout_s=1000000000.0: must be > 0 and <= 1e+06 seconds",
        ),
        ({"parallel": {"placement_timeout_s": 10**400}}, "parallel.placement_timeout_s=<1329-bit int>: must be finite"),
        ({"parallel": {"step_timeout_s": float("nan")}}, "parallel.step_timeout_s=nan: must be finite"),
        (
            {"model": {"seed": 2**64}},
            "model.seed=18446744073709551616: must be an integer in [-9223372036854775808, "
            "9223372036854775807] (int64)",
        ),
        ({"model": {"seed": 2**63}}, "model.seed=9223372036854775808: must be an integer in"),
        ({"model": {"max_model_len": 2**40}}, "model.max_model_len=1099511627776: must be in [1, 16777216]"),
        ({"cache": {"num_gpu_blocks": 2**31}}, "cache.num_gpu_blocks=2147483648: must be in [2, 2147483647]"),
        ({"cache": {"cpu_kv_cache_gib": 1e12}}, "cache.cpu_kv_cache_gib=1000000000000.0: must be > 0 and <= 1048576"),
        (
            {"scheduler": {"max_num_seqs": 2**30, "max_num_batched_tokens": 2**31}},
            "scheduler.max_num_seqs=1073741824: must be in [1, 16777216]",
        ),
        ({"scheduler": {"max_num_batched_tokens": 2**31}}, "scheduler.max_num_batched_tokens=2147483648: must be <="),
        ({"parallel": {"max_worker_restarts": 10**6}}, "parallel.max_worker_restarts=1000000: must be in [0, 1000]"),
        ({"serve": {"health_check_period_s": 0.1}}, "serve.health_check_period_s=0.1: must be in [0.5, 3600] seconds"),
        ({"ray": {"num_cpus": 2**40}}, "ray.num_cpus=1099511627776: must be in [1, 1048576], or null"),
        ({"model": {"model": "a\udc80b"}}, "config: model.model: not valid Unicode (lone surrogate U+DC80 at index 1)"),
        ({"model": {"model": "m" * 5000}}, "model.model='mmmmmmmmmmmm"),
        (
            {"model": {"model": ["x"] * 10**5}},
            "model.model=['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', ...]: must be a string",
        ),
    ],
)
def test_out_of_range_values_get_a_named_error(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert message in str(e.value)
    assert len(str(e.value)) < 400


def test_a_5000_char_string_is_refused_by_length():
    with pytest.raises(ConfigError, match="must be at most 4096 characters"):
        EngineConfig().replace(namespace="n" * 5000)


def test_huge_values_from_yaml_and_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  step_timeout_s: 1e300\nmodel:\n  seed: 18446744073709551616\n")
    with pytest.raises(ConfigError, match=r"model.seed=18446744073709551616: must be an integer in .* \(in "):
        load_config(path)
    with pytest.raises(ConfigError, match=r"parallel.step_timeout_s=1e\+300: must be finite"):
        load_config(None, ["parallel.step_timeout_s=1e300"])


def test_values_at_the_edges_are_accepted():
    c = config_from_dict(
        {
            "parallel": {"step_timeout_s": 1e6, "placement_timeout_s": 1e-3},
            "model": {"seed": 2**63 - 1, "max_model_len": 2**24},
            "cache": {"num_gpu_blocks": 2**31 - 1},
        }
    )
    assert c.model.seed == 2**63 - 1 and c.parallel.step_timeout_s == 1e6
