"""Shared constants of the server tier (imported by conftest.py and the test modules;
a uniquely named module, since several conftest.py files exist in this repo)."""
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CPU_SHIM_DIR = HERE / "cpu_shim"  # test-only SGLang plugin, see cpu_shim/kvguard_test_cpu_shim.py
CPU_SHIM_PLUGIN = "kvguard_test_cpu_shim"
STUBS_DIR = REPO / "tests" / "stubs"  # stand-ins for torchvision / sgl_kernel (no CPU wheels)

# The incident geometry, scaled down: prefill's pool is smaller than the advertised
# context; decode's pool holds the whole context.
CONTEXT_LENGTH = 1024
PREFILL_POOL = 256
DECODE_POOL = 2048
VOCAB = 256
MLA_SHIM_PLUGIN = "kvguard_test_mla_shim"  # cpu_shim/kvguard_test_mla_shim.py: MLA on torch_native


def make_tiny_mla_model(dir, *, context_length: int = CONTEXT_LENGTH, vocab: int = VOCAB,
                        weights_seed=None) -> Path:
    """A tiny DeepSeek-V2 (MLA) model directory: the tiny Llama's tokenizer, a hand-written
    ``DeepseekV2ForCausalLM`` config (2 dense layers, kv_lora_rank 32, qk_rope_head_dim 16,
    no q LoRA) and, with ``weights_seed``, seeded random weights written by transformers'
    own ``DeepseekV2ForCausalLM`` (start with ``load_format="auto"``)."""
    import json
    import shutil

    from sglang_kvguard.demo.tinymodel import make_tiny_model

    out = Path(dir)
    stamp = out / "kvguard_tiny_mla.json"
    spec = {"context_length": context_length, "vocab": vocab, "weights_seed": weights_seed, "v": 2}
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return out
    base = make_tiny_model(out.parent / (out.name + "-tokenizer"), context_length=context_length, vocab=vocab)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("config.json", "kvguard_tiny_model.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    cfg = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
        "v_head_dim": 16, "head_dim": 16,
        # every layer dense (first_k_dense_replace = layers): no MoE kernels on CPU
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
        "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True,
        "hidden_act": "silu", "max_position_embeddings": context_length, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # SGLang's CPU rotary embedding supports only DeepSeek's YaRN for this model
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 1.0,
                         "original_max_position_embeddings": context_length, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if weights_seed is not None:
        import torch
        from transformers import AutoConfig, DeepseekV2ForCausalLM

        hf = AutoConfig.from_pretrained(str(out))
        # transformers' default scale: attention stays spread over the context, so KV
        # written into any page a request attends to changes its logprobs
        hf.initializer_range = 0.02
        torch.manual_seed(weights_seed)
        DeepseekV2ForCausalLM(hf).save_pretrained(str(out), safe_serialization=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))  # keep the hand-written config
    stamp.write_text(json.dumps(spec))
    return out


ROTATION_ENV = "KVGUARD_SERVER_ROTATION"


def rotating_module(release, what: str) -> None:
    """Skip ``what`` unless this release is the one the CI run picked for it.

    The slowest server modules (the chaos soak, the smoke test's record) run on one of
    the CI releases per run: scripts/run-tests.sh sets ``KVGUARD_SERVER_ROTATION`` to a
    release picked by the commit hash, so each release gets them every few commits.
    Unset (a module run alone, scripts/soak.sh) or ``all``: every release."""
    import pytest

    chosen = os.environ.get(ROTATION_ENV, "all")
    if chosen != "all" and release.version != chosen:
        pytest.skip(f"{what} runs on {chosen} in this CI run (the release rotates by commit; "
                    f"{ROTATION_ENV}=all: on every release)")
