"""Per-pool vLLM profiles and engine choice; no vLLM needed (the real one is used if present).

Every keyword a profile produces is checked against vLLM's own ``AsyncEngineArgs`` fields when
vLLM is installed, else against the field list recorded from vLLM (``vllm_engine_args_fields.txt``),
so a renamed or removed vLLM option fails here rather than at a worker's start.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from laneway.errors import ConfigError
from laneway.settings import load_settings
from tests.vllm_fixtures import make_tiny_model, recorded_engine_arg_fields
from workers import select
from workers.profiles import (
    EngineProfile,
    build_profile,
    check_engine_args,
    quantized_variant,
)
from workers.settings import WorkerSettings
from workers.sim import SimEngine
from workers.upstream import OpenAICompatibleEngine
from workers.vllm_engine import VllmEngine

# Importing vLLM (only where it is installed) warns about torch's and its own deprecations.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore::DeprecationWarning:(torch|vllm|transformers)\b"),
    pytest.mark.filterwarnings(r"ignore::FutureWarning:(torch|vllm|transformers)\b"),
]


def _settings(pool: str = "completion", **overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {"pool": pool, "engine": "vllm", "vllm_model": "/models/m"}
    values.update(overrides)
    return WorkerSettings(**values)


@pytest.fixture(scope="module")
def engine_arg_fields() -> frozenset[str]:
    """``AsyncEngineArgs`` field names: the installed vLLM's, else the recorded ones."""
    if not select.vllm_installed():
        return recorded_engine_arg_fields()
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    return frozenset(f.name for f in dataclasses.fields(arg_utils.AsyncEngineArgs))


def _every_profile() -> Iterator[tuple[str, EngineProfile]]:
    """Each pool × profile × device × quantization source × KV offload that can be built."""
    for pool, which, accelerator, fp8, checkpoint, offload in itertools.product(
        ("completion", "chat", "batch"),
        ("pool", "quantized"),
        (False, True),
        (False, True),
        ("", "/models/m-w8a8"),
        (0.0, 8.0),
    ):
        settings = _settings(
            pool,
            vllm_profile=which,
            vllm_quantized_model=checkpoint,
            vllm_kv_offload_gib=offload,
            vllm_max_model_len=4096,
            vllm_kv_cache_gib=2.0,
        )
        label = f"{pool}/{which}/accel={accelerator}/fp8={fp8}/ckpt={bool(checkpoint)}/kv={offload}"
        try:
            yield label, build_profile(settings, accelerator=accelerator, fp8_supported=fp8)
        except ConfigError:
            assert which == "quantized"
            assert not fp8
            assert not checkpoint


def test_every_profile_argument_is_an_async_engine_args_field(
    engine_arg_fields: frozenset[str],
) -> None:
    produced: set[str] = set()
    for label, profile in _every_profile():
        unknown = set(profile.engine_args) - engine_arg_fields
        assert not unknown, f"{label}: AsyncEngineArgs has no {sorted(unknown)}"
        produced.update(profile.engine_args)
    # The combinations above reach every option the profiles can produce.
    assert produced >= {
        "model",
        "load_format",
        "dtype",
        "quantization",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "scheduling_policy",
        "disable_log_stats",
        "enforce_eager",
        "max_model_len",
        "kv_cache_memory_bytes",
        "gpu_memory_utilization",
        "kv_offloading_size",
        "kv_offloading_backend",
    }


@pytest.mark.skipif(not select.vllm_installed(), reason="vLLM not installed: nothing to compare")
def test_recorded_field_list_matches_the_installed_vllm(engine_arg_fields: frozenset[str]) -> None:
    recorded = recorded_engine_arg_fields()
    new, gone = sorted(engine_arg_fields - recorded), sorted(recorded - engine_arg_fields)
    assert not new
    assert not gone, f"stale record, rewrite it: python -m tests.vllm_fixtures record ({gone})"


def test_a_renamed_option_is_refused(engine_arg_fields: frozenset[str]) -> None:
    check_engine_args({"enable_prefix_caching": True}, engine_arg_fields)
    with pytest.raises(ConfigError, match="enable_prefix_cache"):
        check_engine_args({"enable_prefix_cache": True}, engine_arg_fields)


def test_completion_profile_is_half_precision_prefix_cached_and_capped() -> None:
    profile = build_profile(_settings("completion"), accelerator=True, fp8_supported=True)
    args = profile.engine_args
    assert profile.name == "completion"
    assert profile.max_tokens_cap == 128  # LANEWAY_COMPLETION_MAX_TOKENS's default
    assert args["dtype"] == "bfloat16"
    assert args["enable_prefix_caching"] is True
    assert args["scheduling_policy"] == "priority"
    assert "quantization" not in args
    assert profile.quantization == "none"
    fp16 = build_profile(_settings(vllm_dtype="float16"), accelerator=True, fp8_supported=False)
    assert fp16.engine_args["dtype"] == "float16"


def test_the_completion_cap_is_the_one_the_ingress_enforces() -> None:
    """An operator who raises LANEWAY_COMPLETION_MAX_TOKENS gets completions that long from
    vLLM too, not text cut at 128 tokens with ``length`` while the ingress took the request."""
    for cap in (64, 512):
        settings = _settings("completion", completion_max_tokens=cap)
        assert build_profile(settings, accelerator=True, fp8_supported=True).max_tokens_cap == cap
        quantized = _settings("completion", completion_max_tokens=cap, vllm_profile="quantized")
        assert build_profile(quantized, accelerator=True, fp8_supported=True).max_tokens_cap == cap


def test_chat_profile_is_quantized_long_context_with_kv_offload() -> None:
    settings = _settings("chat", vllm_kv_offload_gib=16.0)
    fp8 = build_profile(settings, accelerator=True, fp8_supported=True)
    assert fp8.quantization == "fp8"
    assert fp8.engine_args["quantization"] == "fp8"
    assert fp8.engine_args["enable_chunked_prefill"] is True
    assert "max_model_len" not in fp8.engine_args  # the model's whole window
    assert fp8.engine_args["kv_offloading_size"] == 16.0
    assert fp8.max_tokens_cap is None

    w8a8 = build_profile(
        _settings("chat", vllm_quantized_model="/models/m-w8a8"),
        accelerator=True,
        fp8_supported=True,
    )
    assert w8a8.quantization == "checkpoint"
    assert w8a8.engine_args["model"] == "/models/m-w8a8"
    assert "quantization" not in w8a8.engine_args  # read from the checkpoint's config

    cpu = build_profile(settings, accelerator=False, fp8_supported=False)
    assert cpu.quantization == "none"
    assert "kv_offloading_size" not in cpu.engine_args
    assert "gpu_memory_utilization" not in cpu.engine_args
    assert any("unquantized" in note for note in cpu.notes)
    assert any("KV offload off" in note for note in cpu.notes)


def test_batch_profile_is_full_precision_without_prefix_cache() -> None:
    profile = build_profile(_settings("batch"), accelerator=True, fp8_supported=True)
    assert profile.engine_args["enable_prefix_caching"] is False
    assert profile.engine_args["dtype"] == "auto"
    assert "quantization" not in profile.engine_args
    assert profile.max_tokens_cap is None


def test_quantized_variant_is_the_breakers_level_one() -> None:
    settings = _settings("completion", vllm_profile="quantized")
    fp8 = build_profile(settings, accelerator=True, fp8_supported=True)
    assert fp8.name == "completion-quantized"
    assert fp8.quantization == "fp8"
    assert fp8.max_tokens_cap == settings.completion_max_tokens
    assert fp8.engine_args["enable_prefix_caching"] is True
    with pytest.raises(ConfigError, match="LANEWAY_VLLM_QUANTIZED_MODEL"):
        build_profile(settings, accelerator=False, fp8_supported=False)
    chat = build_profile(_settings("chat"), accelerator=True, fp8_supported=True)
    assert quantized_variant(chat, _settings("chat"), fp8_supported=True).quantization == "fp8"


def test_profile_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="LANEWAY_VLLM_MODEL"):
        build_profile(_settings(engine="auto", vllm_model=""), accelerator=True, fp8_supported=True)
    with pytest.raises(ConfigError, match="LANEWAY_VLLM_PROFILE='chat' on a batch worker"):
        build_profile(_settings("batch", vllm_profile="chat"), accelerator=True, fp8_supported=True)
    same = build_profile(
        _settings("batch", vllm_profile="batch"), accelerator=True, fp8_supported=True
    )
    assert same.name == "batch"
    sized = build_profile(
        _settings(vllm_kv_cache_gib=1.5, vllm_max_model_len=2048),
        accelerator=False,
        fp8_supported=False,
    )
    assert sized.engine_args["kv_cache_memory_bytes"] == int(1.5 * (1 << 30))
    assert sized.engine_args["max_model_len"] == 2048


# --- engine choice ----------------------------------------------------------------------------


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set what the machine has: ``machine(vllm=..., accelerator=...)``."""

    def configure(*, vllm: bool, accelerator: bool) -> None:
        monkeypatch.setattr(select, "vllm_installed", lambda: vllm)
        monkeypatch.setattr(select, "has_accelerator", lambda: accelerator)

    return configure


async def test_auto_picks_vllm_with_vllm_an_accelerator_and_a_model(machine: Any) -> None:
    machine(vllm=True, accelerator=True)
    engine, reason = select.choose_engine(_settings(engine="auto", upstream_url="http://u/v1"))
    assert isinstance(engine, VllmEngine)
    assert reason == "vLLM installed, an accelerator present, model /models/m"


async def test_auto_falls_back_to_openai_then_sim_and_says_why(machine: Any) -> None:
    machine(vllm=True, accelerator=True)
    engine, reason = select.choose_engine(
        _settings(engine="auto", vllm_model="", upstream_url="http://u/v1")
    )
    assert isinstance(engine, OpenAICompatibleEngine)
    assert reason == "LANEWAY_UPSTREAM_URL is set (http://u/v1); not vllm: LANEWAY_VLLM_MODEL unset"
    await engine.stop()

    machine(vllm=False, accelerator=False)
    engine, reason = select.choose_engine(_settings(engine="auto"))
    assert isinstance(engine, SimEngine)
    assert reason.startswith("no accelerator, vLLM not installed and LANEWAY_UPSTREAM_URL unset")
    assert "SIMULATED" in reason


async def test_explicit_vllm_runs_on_cpu_but_needs_vllm_and_a_model(machine: Any) -> None:
    machine(vllm=True, accelerator=False)
    engine, reason = select.choose_engine(_settings())
    assert isinstance(engine, VllmEngine)
    assert reason == "LANEWAY_ENGINE=vllm: model /models/m on the CPU (no accelerator found)"
    with pytest.raises(ConfigError, match="LANEWAY_ENGINE=vllm needs LANEWAY_VLLM_MODEL"):
        load_settings(WorkerSettings, engine="vllm", vllm_model="")  # before anything starts
    machine(vllm=False, accelerator=True)
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        select.choose_engine(_settings())


# --- opt-in: the profiles against the real vLLM's config validation ---------------------------


@pytest.mark.vllm
@pytest.mark.skipif(not select.vllm_installed(), reason="vLLM is not installed: make test-vllm")
@pytest.mark.parametrize("pool", ["completion", "chat", "batch"])
def test_real_vllm_accepts_the_cpu_profiles(pool: str, tmp_path: Path) -> None:
    """vLLM builds its full engine config from each profile (no engine is started)."""
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    model = make_tiny_model(tmp_path / "tiny")
    settings = _settings(pool, vllm_model=str(model), vllm_load_format="dummy")
    profile = build_profile(settings, accelerator=False, fp8_supported=False)
    config = arg_utils.AsyncEngineArgs(**profile.engine_args).create_engine_config()
    assert config.cache_config.enable_prefix_caching is (pool != "batch")
    assert config.scheduler_config.policy == "priority"
