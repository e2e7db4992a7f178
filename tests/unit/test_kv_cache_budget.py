"""KV pool sizing: explicit sizes win, the auto size follows the memory that is really available (host,
cgroup v2 or v1 limit), net of the weights, and stays within what the scheduler could ever use."""
import dataclasses
import logging
import math

import pytest

from epdserve.shared.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from epdserve.shared.engine.kv_cache_budget import GiB, MemoryLimit, available_memory, size_kv_cache

MiB = 1 << 20

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 -> 46,080 bytes a token in float32.
MODEL = ModelConfig(path="/m", architecture="LlamaForCausalLM", dtype_name="float32", vocab_size=49152,
                    hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_size=64,
                    rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None, max_model_len=8192,
                    tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None,
                    eos_token_ids=(2,))
BLOCK_BYTES = 46080 * 16


def engine(cache: CacheConfig = CacheConfig(), max_num_seqs: int = 128, **model) -> EngineConfig:
    return EngineConfig(dataclasses.replace(MODEL, **model), cache, SchedulerConfig(max_num_seqs=max_num_seqs))


def test_weights_of_a_llama_shaped_model_match_its_checkpoint():
    assert MODEL.num_weight_bytes == 134_515_008 * 4  # SmolLM2-135M's parameter count, float32
    untied = dataclasses.replace(MODEL, tie_word_embeddings=False, dtype_name="bfloat16")
    assert untied.num_weight_bytes == (134_515_008 + 49152 * 576) * 2


def test_smollm2_weights_are_counted_from_its_config(default_model_path):
    from safetensors import safe_open

    from epdserve.shared.models.weights import safetensors_files

    numel = 0
    for path in safetensors_files(default_model_path):
        with safe_open(str(path), framework="pt") as f:
            numel += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert ModelConfig.from_pretrained(default_model_path).num_weight_bytes == numel * 4


def test_num_blocks_wins_over_bytes_and_bytes_over_auto():
    limit = MemoryLimit(1 * GiB, "test")
    size = size_kv_cache(engine(CacheConfig(kv_cache_memory_bytes=64 * MiB, num_blocks=10)), limit)
    assert (size.num_blocks, size.num_bytes, size.reason) == (10, 10 * BLOCK_BYTES, "num_kv_blocks given")
    size = size_kv_cache(engine(CacheConfig(kv_cache_memory_bytes=64 * MiB, kv_cache_memory_fraction=0.5)), limit)
    assert size.num_blocks == 64 * MiB // BLOCK_BYTES and "kv_cache_memory 0.06 GiB given" in size.reason
    with pytest.raises(ValueError, match="holds no block"):
        size_kv_cache(engine(CacheConfig(kv_cache_memory_bytes=1000)), limit)


# int8: a row of 64 values takes 66 bytes (its float16 scale), 256/66 of float32's 256.
@pytest.mark.parametrize("cache_dtype, per_float32_block", [("auto", 1), ("bfloat16", 2), ("fp8", 4),
                                                             ("fp8_e4m3", 4), ("fp8_e5m2", 4), ("int8", 256 / 66)])
def test_a_narrower_kv_cache_holds_more_blocks_in_the_same_memory(cache_dtype, per_float32_block):
    size = size_kv_cache(engine(CacheConfig(kv_cache_memory_bytes=64 * BLOCK_BYTES, cache_dtype=cache_dtype)))
    assert size.num_blocks == int(64 * per_float32_block)
    block_bytes = BLOCK_BYTES / per_float32_block
    assert size.num_bytes == size.num_blocks * block_bytes <= 64 * BLOCK_BYTES


@pytest.mark.parametrize("cache_dtype", ["fp8_inc", "int4", "float32", "int8_per_tensor"])
def test_a_kv_cache_dtype_not_supported_is_refused_naming_the_choices(cache_dtype):
    with pytest.raises(ValueError, match=f"kv_cache_dtype '{cache_dtype}' is not supported; choose one of auto, "
                                         "bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8"):
        CacheConfig(cache_dtype=cache_dtype)


def test_auto_size_is_a_fraction_of_what_is_left_after_the_weights():
    limit = MemoryLimit(20 * GiB, "host MemAvailable")
    spare = 20 * GiB - MODEL.num_weight_bytes
    size = size_kv_cache(engine(max_num_seqs=4), limit)  # CPU default: 0.05
    assert size.num_blocks == int(spare * 0.05) // BLOCK_BYTES
    assert size.num_bytes == size.num_blocks * BLOCK_BYTES
    assert size.reason == "auto: 0.05 x (20.00 GiB available (host MemAvailable) - 0.50 GiB of weights)"
    half = size_kv_cache(engine(CacheConfig(kv_cache_memory_fraction=0.1), max_num_seqs=8), limit)
    assert half.num_blocks == int(spare * 0.1) // BLOCK_BYTES


def test_auto_size_never_exceeds_what_the_scheduler_could_use():
    # 2 sequences of 512 tokens need 64 blocks, far below 5% of 20 GiB.
    size = size_kv_cache(engine(max_num_seqs=2, max_model_len=512), MemoryLimit(20 * GiB, "host MemAvailable"))
    assert size.num_blocks == 64
    assert size.reason.endswith("capped at 2 sequences of 512 tokens")


def test_auto_size_holds_at_least_one_full_length_sequence_when_memory_allows():
    # 5% of 2 GiB is ~77 MiB, less than one 8192-token sequence (360 MiB): raised to that sequence.
    size = size_kv_cache(engine(), MemoryLimit(2 * GiB, "cgroup v2 memory.max"))
    assert size.num_blocks == 8192 // 16
    assert size.reason.endswith("raised to fit one sequence of 8192 tokens")
    # Not when that sequence would take more than half of what is left: then the fraction stands.
    small = size_kv_cache(engine(), MemoryLimit(MODEL.num_weight_bytes + 600 * MiB, "cgroup v2 memory.max"))
    assert small.num_blocks == int(600 * MiB * 0.05) // BLOCK_BYTES
    assert "too small for a sequence of 8192 tokens" in small.reason


def test_no_room_for_the_weights_is_an_error_naming_the_way_out():
    with pytest.raises(ValueError, match="no memory for a KV cache.*kv_cache_memory or num_kv_blocks"):
        size_kv_cache(engine(), MemoryLimit(MODEL.num_weight_bytes, "host MemAvailable"))


def fake_root(tmp_path, meminfo_kb: tuple[int, int], cgroup: str, files: dict[str, str]):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal:       {meminfo_kb[0]} kB\nMemFree: 1 kB\n"
                                              f"MemAvailable:   {meminfo_kb[1]} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys" / "fs" / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_host_memavailable_without_a_cgroup_limit(tmp_path):
    root = fake_root(tmp_path, (24 << 20, 20 << 20), "0::/\n", {"memory.max": "max\n", "memory.current": "5\n"})
    assert available_memory("cpu", root) == MemoryLimit(20 * GiB, "host MemAvailable")


def test_cgroup_v2_limit_minus_usage_not_counting_reclaimable_cache(tmp_path):
    root = fake_root(tmp_path, (24 << 20, 20 << 20), "0::/job/engine\n", {
        "job/memory.max": str(8 * GiB), "job/memory.current": str(1 * GiB),
        "job/engine/memory.max": str(4 * GiB), "job/engine/memory.current": str(1 * GiB),
        "job/engine/memory.stat": f"anon 1\ninactive_file {512 * MiB}\nactive_file 7\n"})
    assert available_memory("cpu", root) == MemoryLimit(4 * GiB - 512 * MiB, "cgroup v2 memory.max")


def test_cgroup_v2_inside_a_namespace_reads_the_mount_root(tmp_path):
    root = fake_root(tmp_path, (24 << 20, 20 << 20), "0::/\n",
                     {"memory.max": str(2 * GiB), "memory.current": str(GiB // 2)})
    assert available_memory("cpu", root) == MemoryLimit(GiB * 3 // 2, "cgroup v2 memory.max")


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    limited = fake_root(tmp_path / "a", (24 << 20, 20 << 20), "5:cpu,cpuacct:/\n4:memory:/pod\n", {
        "memory/pod/memory.limit_in_bytes": str(6 * GiB), "memory/pod/memory.usage_in_bytes": str(2 * GiB),
        "memory/pod/memory.stat": f"cache 3\ntotal_inactive_file {GiB}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712"})
    assert available_memory("cpu", limited) == MemoryLimit(5 * GiB, "cgroup v1 memory.limit_in_bytes")
    unlimited = fake_root(tmp_path / "b", (24 << 20, 20 << 20), "4:memory:/gone\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"})
    assert available_memory("cpu", unlimited) == MemoryLimit(20 * GiB, "host MemAvailable")


def test_host_memory_wins_when_it_is_tighter_than_the_cgroup(tmp_path):
    root = fake_root(tmp_path, (24 << 20, 3 << 20), "0::/\n", {"memory.max": str(16 * GiB), "memory.current": "0"})
    assert available_memory("cpu", root) == MemoryLimit(3 * GiB, "host MemAvailable")


def test_this_machine_reports_some_memory():
    limit = available_memory("cpu")
    assert limit.num_bytes > 0 and limit.source


def test_the_engine_logs_what_it_chose_and_why(tiny_model_paths, caplog):
    from epdserve.shared.engine.llm import LLM

    with caplog.at_level(logging.INFO, logger="epdserve.shared.engine.llm_engine"):
        llm = LLM(model=tiny_model_paths["llama"], max_model_len=256, max_num_seqs=4)
    num_blocks = llm.engine.block_manager.num_blocks
    assert num_blocks == 4 * 256 // 16  # the tiny model's pool is capped by what 4 sequences need
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    block_bytes = llm.engine.model_config.kv_bytes_per_token() * 16
    assert line.startswith(f"KV cache: {num_blocks} blocks of 16 tokens ({num_blocks * 16} tokens) in float32, "
                           f"{num_blocks * block_bytes} bytes; auto: 0.05 x (")
    assert "available (" in line and line.endswith("capped at 4 sequences of 256 tokens")
