"""A tiny, deterministic, download-free Llama checkpoint for CPU tests and demos.

``make_tiny_model(dir)`` writes a 2-layer Llama (hidden 64, 4 heads, 2 KV heads)
config plus a locally built WordLevel tokenizer. Weights are not needed: servers
are started with ``--load-format dummy`` (or, with ``weights_seed``, seeded random
weights are written too). The tokenizer maps every word
``w0 .. w{n-1}`` to exactly one token, with no BOS/EOS added, so
``prompt_of_tokens(n)`` is a prompt of exactly ``n`` tokens.

transformers / tokenizers are imported inside the functions only.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "SPECIAL_TOKENS",
    "make_tiny_model",
    "model_fingerprint",
    "prompt_of_tokens",
    "word_count",
]

# id 0..3; every other id is a plain word "w<k>".
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
_STAMP = "kvguard_tiny_model.json"
_FORMAT = 1


def _n_words(vocab: int) -> int:
    return vocab - len(SPECIAL_TOKENS)


def prompt_of_tokens(n: int, *, vocab: int = 256, offset: int = 0) -> str:
    """Return a prompt of exactly ``n`` tokens for a model made with ``vocab``.

    Words cycle through ``w0 .. w{vocab-5}``; ``offset`` shifts the cycle so two
    prompts of the same length can differ.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    m = _n_words(vocab)
    return " ".join(f"w{(offset + i) % m}" for i in range(n))


def word_count(prompt: str) -> int:
    """Number of tokens the tiny tokenizer makes of ``prompt`` (one per word)."""
    return len(prompt.split())


def _spec(context_length: int, vocab: int, weights_seed: Optional[int] = None) -> dict:
    spec = {} if weights_seed is None else {"weights_seed": int(weights_seed)}
    return {
        **spec,
        "format": _FORMAT,
        "context_length": int(context_length),
        "vocab": int(vocab),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }


def _write(tmp: Path, spec: dict) -> None:
    # Lazy imports: kvguard itself must import without these libraries.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = spec["vocab"]
    table = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for k in range(_n_words(vocab)):
        table[f"w{k}"] = len(table)
    # Built from an explicit table (no training data, no randomness): the same
    # arguments always give byte-identical files.
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    fast.model_max_length = spec["context_length"]
    fast.save_pretrained(str(tmp))

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec["context_length"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(tmp))
    if spec.get("weights_seed") is not None:
        # Seeded random weights with a large init scale: unlike SGLang's dummy
        # weights (uniform +-1e-3, every logit ~0, every output token equally likely),
        # the output depends on the context, so a test can see KV it did not write.
        import torch
        from transformers import LlamaForCausalLM

        cfg.initializer_range = 0.5
        torch.manual_seed(spec["weights_seed"])
        LlamaForCausalLM(cfg).save_pretrained(str(tmp), safe_serialization=True)
    # Without weights servers run with --load-format dummy. A generation config
    # keeps SGLang from guessing sampling defaults.
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2)
    )
    (tmp / _STAMP).write_text(json.dumps(spec, indent=2, sort_keys=True))


def make_tiny_model(
    dir: Union[str, os.PathLike],
    *,
    context_length: int = 1024,
    vocab: int = 256,
    weights_seed: Optional[int] = None,
) -> Path:
    """Create (or reuse) a tiny Llama model directory at ``dir`` and return it.

    ``weights_seed``: also write seeded random weights (``model.safetensors``; start
    servers with ``load_format="auto"``); without it there is no weight file.

    Idempotent: if ``dir`` already holds a model made with the same arguments it
    is reused untouched; if it holds one made with other arguments it is
    rebuilt. Writing goes through a temporary sibling directory and an atomic
    rename, so a concurrent caller never sees a half-written model.
    """
    if vocab < len(SPECIAL_TOKENS) + 2:
        raise ValueError(f"vocab must be >= {len(SPECIAL_TOKENS) + 2}")
    if context_length < 16:
        raise ValueError("context_length must be >= 16")
    path = Path(dir)
    spec = _spec(context_length, vocab, weights_seed)
    stamp = path / _STAMP
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == spec:
                return path
        except (OSError, ValueError):
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=str(path.parent)))
    try:
        _write(tmp, spec)
        if path.exists():
            import shutil

            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=str(path.parent)))
            os.rename(path, old / "m")
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, path)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def model_fingerprint(dir: Union[str, os.PathLike]) -> str:
    """sha256 over the model directory's files (for determinism checks)."""
    h = hashlib.sha256()
    for p in sorted(Path(dir).iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()
