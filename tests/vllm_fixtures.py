"""A tiny local model for the opt-in vLLM tests: no hub download, random weights.

``make_tiny_model(path)`` writes a 2-layer Llama config (head size 64) and a byte-level BPE
tokenizer trained here with ``tokenizers`` on a small code-like corpus, with a chat template.
vLLM serves it with ``load_format="dummy"``: the text is nonsense, but every token goes
through the real scheduler, KV cache, prefix cache and sampler. Its end-of-text token lies
outside the model's vocabulary, so random weights never end a request early: every request
runs to ``max_tokens`` (or its abort), which keeps the tests deterministic.

``python -m tests.vllm_fixtures record`` (in the vLLM venv) rewrites the recorded
``AsyncEngineArgs`` field list that the default unit tests check profiles against.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

__all__ = ["RECORDED_FIELDS", "make_tiny_model", "recorded_engine_arg_fields"]

RECORDED_FIELDS = Path(__file__).with_name("vllm_engine_args_fields.txt")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
_END_OF_TEXT = "<|endoftext|>"

_CORPUS_LINES = [
    "def add(a, b):\n    return a + b\n",
    "class Tree:\n    def __init__(self, left=None, right=None):\n        self.left = left\n",
    "for index, value in enumerate(items):\n    total += value * index\n",
    "import asyncio\nasync def main() -> None:\n    await asyncio.sleep(0)\n",
    "explain this diff and be brief about the change to the request handler\n",
    "the quick brown fox jumps over the lazy dog while the cache stays warm\n",
    "if key in cache:\n    return cache[key]\nraise KeyError(key)\n",
]


def _corpus() -> list[str]:
    lines = []
    for i in range(200):
        for line in _CORPUS_LINES:
            lines.append(line.replace("a", "a" * (1 + i % 3)) + f"# line {i}\n")
    return lines


def _write_tokenizer(path: Path, vocab_size: int) -> tuple[int, int]:
    """Train and save the tokenizer; returns (model vocabulary size, end-of-text id)."""
    # Lazy: tokenizers (and vLLM below) live in the vLLM venv only.
    from tokenizers import (  # noqa: PLC0415
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    model_vocab = int(tokenizer.get_vocab_size())
    # Added after training: the id just past the model's vocabulary, which it cannot sample.
    tokenizer.add_special_tokens([_END_OF_TEXT])
    end_of_text = int(tokenizer.token_to_id(_END_OF_TEXT))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": _END_OF_TEXT,
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": _END_OF_TEXT, "unk_token": "<unk>"})
    )
    return model_vocab, end_of_text


def make_tiny_model(path: Path, *, vocab_size: int = 1024, max_len: int = 2048) -> Path:
    """Write a tiny Llama model directory (config + tokenizer, no weights) at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    vocab, end_of_text = _write_tokenizer(path, vocab_size)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "vocab_size": vocab,
        "bos_token_id": 1,
        "eos_token_id": end_of_text,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": end_of_text})
    )
    return path


def recorded_engine_arg_fields() -> frozenset[str]:
    """``AsyncEngineArgs`` field names as recorded from the vLLM version named in the file."""
    lines = RECORDED_FIELDS.read_text().splitlines()
    return frozenset(line for line in lines if line and not line.startswith("#"))


def _record() -> None:
    vllm = importlib.import_module("vllm")
    arg_utils = importlib.import_module("vllm.engine.arg_utils")
    names = sorted(f.name for f in dataclasses.fields(arg_utils.AsyncEngineArgs))
    header = [
        f"# vllm.engine.arg_utils.AsyncEngineArgs fields, recorded from vLLM {vllm.__version__}",
        "# Rewrite with: .venv-vllm/bin/python -m tests.vllm_fixtures record",
    ]
    RECORDED_FIELDS.write_text("\n".join([*header, *names]) + "\n")
    print(f"recorded {len(names)} fields of vLLM {vllm.__version__} in {RECORDED_FIELDS}")


if __name__ == "__main__":
    if sys.argv[1:] == ["record"]:
        _record()
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "model":
        max_len = int(sys.argv[3]) if len(sys.argv) == 4 else 2048
        print(make_tiny_model(Path(sys.argv[2]), max_len=max_len))
    else:
        sys.exit("usage: python -m tests.vllm_fixtures record | model DIR [MAX_LEN]")
