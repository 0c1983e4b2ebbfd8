"""Config loading and validation: a table of bad configs (each with the message it must give), CLI-style
overrides, YAML files, LLM-style keyword mapping, and the rules that need the model's config."""

import pytest

from cluster.config import (
    ConfigError,
    EngineConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    parse_override,
    validate_for_model,
)

BAD = [
    ({"cach": {}}, "unknown section(s) ['cach']"),
    ({"cache": {"blok_size": 16}}, "unknown key(s) ['cache.blok_size']"),
    ({"cache": {"block_size": 12}}, "cache.block_size=12: must be a power of two"),
    ({"cache": {"block_size": 0}}, "cache.block_size=0: must be a power of two"),
    ({"cache": {"block_size": "16"}}, "cache.block_size='16': must be an integer"),
    ({"cache": {"block_size": 16.0}}, "cache.block_size=16.0: must be an integer"),
    ({"cache": {"num_gpu_blocks": 1}}, "cache.num_gpu_blocks=1: must be in [2, 2147483647]"),
    ({"cache": {"gpu_memory_utilization": 1.5}}, "cache.gpu_memory_utilization=1.5: must be in (0, 1]"),
    ({"cache": {"gpu_memory_utilization": 0}}, "cache.gpu_memory_utilization=0.0: must be in (0, 1]"),
    ({"cache": {"cpu_kv_cache_gib": -1}}, "cache.cpu_kv_cache_gib=-1.0: must be > 0"),
    ({"cache": {"enable_prefix_caching": "yes"}}, "cache.enable_prefix_caching='yes': must be a bool"),
    ({"cache": {"kv_cache_dtype": "fp16"}}, "cache.kv_cache_dtype='fp16': must be one of ['auto', 'fp8'"),
    ({"cache": 5}, "cache=5: a section must be a mapping"),
    ({"model": {"model": ""}}, "model.model='': must name an HF model directory"),
    ({"model": {"dtype": "fp8"}}, "model.dtype='fp8': must be one of"),
    ({"model": {"max_model_len": 0}}, "model.max_model_len=0: must be in [1, 16777216]"),
    ({"model": {"seed": -3}}, "model.seed=-3: must be in [0, 9223372036854775807] (int64)"),
    ({"model": {"attention_backend": "flash"}}, "model.attention_backend='flash': must be one of"),
    ({"model": {"model": None}}, "model.model=None: must be a str, not null"),
    ({"parallel": {"tensor_parallel_size": 0}}, "parallel.tensor_parallel_size=0: must be in [1, 1024]"),
    ({"parallel": {"tensor_parallel_size": True}}, "parallel.tensor_parallel_size=True: must be an integer"),
    ({"parallel": {"data_parallel_size": -1}}, "parallel.data_parallel_size=-1: must be in [1, 1024]"),
    ({"parallel": {"device": "tpu"}}, "parallel.device='tpu': must be one of ['auto', 'cpu', 'cuda']"),
    ({"parallel": {"placement_strategy": "pack"}}, "parallel.placement_strategy='pack': must be one of"),
    ({"parallel": {"gpus_per_worker": 2}}, "parallel.gpus_per_worker=2.0: must be in (0, 1]"),
    ({"parallel": {"distributed_backend": "mpi"}}, "parallel.distributed_backend='mpi': must be one of"),
    ({"parallel": {"distributed_backend": "nccl", "device": "cpu"}}, "nccl needs parallel.device=cuda"),
    (
        {"parallel": {"device": "cuda", "gpus_per_worker": 0.5, "distributed_backend": "nccl"}},
        "nccl refuses two ranks on one GPU",
    ),
    ({"parallel": {"placement_timeout_s": 0}}, "parallel.placement_timeout_s=0.0: must be > 0"),
    ({"parallel": {"step_timeout_s": float("inf")}}, "parallel.step_timeout_s=inf: must be finite"),
    ({"parallel": {"max_worker_restarts": -1}}, "parallel.max_worker_restarts=-1: must be in [0, 1000]"),
    ({"parallel": {"max_driver_restarts": -1}}, "parallel.max_driver_restarts=-1: must be in [0, 1000]"),
    ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs=0: must be in [1, 16777216]"),
    (
        {"scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 32}},
        "scheduler.max_num_batched_tokens=32: must be >= scheduler.max_num_seqs (64)",
    ),
    ({"scheduler": {"long_prefill_token_threshold": -1}}, "scheduler.long_prefill_token_threshold=-1"),
    ({"scheduler": {"admission_min_batch": 300}}, "scheduler.admission_min_batch=300: must be in [1, "),
    (
        {"scheduler": {"admission_max_wait_steps": -2}},
        "scheduler.admission_max_wait_steps=-2: must be in [0, 2147483647]",
    ),
    ({"ray": {"transport": "grpc"}}, "ray.transport='grpc': must be one of ['compiled_graph', 'actor_calls', 'shm']"),
    ({"ray": {"namespace": " "}}, "ray.namespace=' ': must not be empty"),
    ({"ray": {"num_cpus": 0}}, "ray.num_cpus=0: must be in [1, 1048576], or null"),
    ([1, 2], "the top level must be a mapping"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_config_names_field_value_and_rule(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert message in str(e.value)


def test_defaults_and_backend_choice():
    c = EngineConfig()
    assert c.model.model == "tiny-random" and c.parallel.tensor_parallel_size == 1
    assert c.parallel.collective_backend == "gloo"
    gpu = config_from_dict({"parallel": {"device": "cuda"}})
    assert gpu.parallel.collective_backend == "nccl"
    shared = config_from_dict({"parallel": {"device": "cuda", "gpus_per_worker": 0.5}})
    assert shared.parallel.collective_backend == "gloo"
    # ints are accepted for float fields and stored as floats
    assert config_from_dict({"parallel": {"step_timeout_s": 5}}).parallel.step_timeout_s == 5.0


def test_overrides_parse_yaml_values():
    assert parse_override("cache.block_size=32") == ("cache.block_size", 32)
    assert parse_override("cache.enable_prefix_caching=false") == ("cache.enable_prefix_caching", False)
    assert parse_override("model.max_model_len=null") == ("model.max_model_len", None)
    assert parse_override("model.model=/x/y") == ("model.model", "/x/y")
    c = apply_overrides(EngineConfig(), ["cache.block_size=32", "parallel.tensor_parallel_size=2"])
    assert c.cache.block_size == 32 and c.parallel.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        parse_override("cache.block_size")
    with pytest.raises(ConfigError, match=r"override 'cache.blocksize': unknown key"):
        apply_overrides(EngineConfig(), ["cache.blocksize=8"])
    with pytest.raises(ConfigError, match=r"override 'nope.x': unknown key"):
        apply_overrides(EngineConfig(), ["nope.x=1"])
    with pytest.raises(ConfigError, match=r"cache.block_size=24: must be a power of two"):
        apply_overrides(EngineConfig(), ["cache.block_size=24"])


def test_llm_style_keywords_map_onto_sections():
    c = EngineConfig().replace(
        model="/m",
        tensor_parallel_size=2,
        device="cpu",
        block_size=32,
        num_gpu_blocks=100,
        gpu_memory_utilization=0.5,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        seed=3,
        dtype="float32",
        data_parallel_size=2,
        transport="actor_calls",
        parallel={"step_timeout_s": 7},
    )
    assert (c.model.model, c.model.max_model_len, c.model.seed, c.model.dtype) == ("/m", 512, 3, "float32")
    assert (c.parallel.tensor_parallel_size, c.parallel.data_parallel_size) == (2, 2)
    assert c.parallel.step_timeout_s == 7.0
    assert (c.cache.block_size, c.cache.num_gpu_blocks, c.cache.enable_prefix_caching) == (32, 100, False)
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (8, 64)
    assert c.ray.transport == "actor_calls"
    with pytest.raises(ConfigError, match="unknown key"):
        EngineConfig().replace(tensor_parallel=2)


def test_yaml_files(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  model: tiny-random\ncache:\n  block_size: 8\n")
    c = load_config(str(p), ["scheduler.max_num_seqs=4"])
    assert c.cache.block_size == 8 and c.scheduler.max_num_seqs == 4
    p.write_text("cache:\n  block_size: 9\n")
    with pytest.raises(ConfigError, match=r"cache.block_size=9: must be a power of two .*\(in .*c.yaml\)"):
        load_config(str(p))
    p.write_text("cache: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(str(tmp_path / "empty.yaml")) == EngineConfig()


def test_shipped_configs_load():
    import glob
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    files = sorted(glob.glob(os.path.join(root, "*.yaml")))
    names = {os.path.basename(f) for f in files}
    assert {
        "local.yaml",
        "local-tp2.yaml",
        "gpu.yaml",
        "gpu-tp2.yaml",
        "gpu-tp4-dp2.yaml",
        "gpu-tp8-pp2.yaml",
        "stress-local.yaml",
    } <= names
    for f in files:
        load_config(f)
    tp2 = load_config(os.path.join(root, "local-tp2.yaml"))
    assert tp2.parallel.tensor_parallel_size == 2 and tp2.parallel.data_parallel_size == 2


def test_rules_that_need_the_model():
    hf = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    validate_for_model(EngineConfig().replace(tensor_parallel_size=2), hf)
    validate_for_model(EngineConfig().replace(tensor_parallel_size=4), hf)  # KV heads replicated
    with pytest.raises(
        ConfigError,
        match=r"parallel.tensor_parallel_size=3: must divide the model's "
        r"num_attention_heads=4",
    ):
        validate_for_model(EngineConfig().replace(tensor_parallel_size=3), hf)
    with pytest.raises(ConfigError, match=r"num_key_value_heads=4, or be a multiple of it"):
        validate_for_model(
            EngineConfig().replace(tensor_parallel_size=6), {"num_attention_heads": 24, "num_key_value_heads": 4}
        )
    with pytest.raises(
        ConfigError,
        match=r"model.max_model_len=1000: must be <= the model's "
        r"max_position_embeddings=256",
    ):
        validate_for_model(EngineConfig().replace(max_model_len=1000), hf)


def test_from_config_validates_against_the_model_before_starting_anything(tmp_path):
    """LLM.from_config: a TP that does not divide the heads fails before any Ray actor starts."""
    from cluster.llm import LLM

    p = tmp_path / "c.yaml"
    p.write_text("model:\n  model: tiny-random\nparallel:\n  tensor_parallel_size: 3\n")
    with pytest.raises(ConfigError, match="tensor_parallel_size=3: must divide the model's num_attention_heads=4"):
        LLM.from_config(str(p))
    with pytest.raises(ConfigError, match="cache.block_size=3"):
        LLM.from_config(str(p), block_size=3)
