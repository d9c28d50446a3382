"""A small real-architecture model for tests and demos, built here: no download needed.

A Llama (grouped-query attention: 4 query heads, 2 KV heads, head_dim 64) with
seeded random weights, saved with ``save_pretrained``, and a word-level
tokenizer (``w0`` ... ``wN``) saved beside it, so that vLLM serves it offline.
The weights are drawn wider than a trained model's (``initializer_range``) so
that greedy decoding has clear winners: a near-uniform next-token distribution
would let rounding noise pick the token. ``python -m
kvxfer.client.integrations.vllm.tiny_model DIR`` writes one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: Its dtype. Not bfloat16: on CPUs with AMX, vLLM 0.32 picks its AMX attention kernel for
#: bfloat16, and that kernel kills the engine (SIGILL) when a step that only continues a
#: loaded prompt is the first after some 10 s of idling (docs/trust.md, measured here).
DTYPE = "float16"
#: Shapes of the test model (what the daemon pools must match: see ``layout``).
VOCAB = 512
LAYERS = 2
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64


def build(directory: str, *, seed: int = 0, layers: int = LAYERS,
          initializer_range: float = 0.08, sliding_window: int = 0) -> Path:
    """Write the model and tokenizer to ``directory`` (created); its path. With
    ``sliding_window`` (tokens), a hybrid: every second layer attends only to that many
    recent tokens (``layer_types``), the others to all, so vLLM keeps two block tables."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = write_tokenizer(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=2048, initializer_range=initializer_range,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype=DTYPE,
        **hybrid_layers(layers, sliding_window))
    model = LlamaForCausalLM(config).to(getattr(torch, DTYPE))
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_mamba_hybrid(directory: str, *, seed: int = 0) -> Path:
    """Write a Mamba2 hybrid (IBM Granite's architecture, ``GraniteMoeHybridForCausalLM``:
    Mamba2 layers 0 and 2, attention layers 1 and 3, no experts) with the tokenizer to
    ``directory``; its path."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    out = write_tokenizer(directory)
    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_local_experts=0,
        shared_intermediate_size=2 * HIDDEN, layer_types=["mamba", "attention"] * 2,
        mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64, position_embedding_type="rope",
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, torch_dtype=DTYPE, initializer_range=0.08)
    model = GraniteMoeHybridForCausalLM(config).to(getattr(torch, DTYPE))
    model.save_pretrained(out, safe_serialization=True)
    return out


def write_tokenizer(directory: str) -> Path:
    """Write the word-level tokenizer (``w0`` ... ``wN``) to ``directory`` (created); its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(VOCAB - 3)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "model_max_length": 2048, "add_bos_token": False,
    }))
    return out


def hybrid_layers(layers: int, sliding_window: int) -> dict[str, object]:
    """The config entries of a model whose odd layers see the last ``sliding_window`` tokens
    (none: every layer sees all)."""
    if not sliding_window:
        return {}
    return {"sliding_window": sliding_window,
            "layer_types": ["sliding_attention" if i % 2 else "full_attention"
                            for i in range(layers)]}


def prompt(seed: int, words: int) -> str:
    """A prompt of ``words`` words of the tiny vocabulary (the same for the same seed)."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(VOCAB - 3)}" for _ in range(words))


def main() -> None:
    """Write the tiny model to the directory named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="a hybrid: odd layers attend to this many recent tokens only")
    args = parser.parse_args()
    print(build(args.directory, seed=args.seed, layers=args.layers,
                sliding_window=args.sliding_window))


if __name__ == "__main__":
    main()
