"""Sample text from a training checkpoint or an exported transformers directory.

    python scripts/generate.py outputs/muon_gpt_tiny/RUN --prompt "def main(" --max-new-tokens 100
    python scripts/generate.py exported/gpt_tiny --prompt "import " --temperature 0.8 --top-k 50

SOURCE is a checkpoint (file, checkpoints/ dir or run dir; our model, decoding with its KV
cache) or a directory written by scripts/export_hf.py (loaded with transformers). Greedy by
default (--temperature 0); otherwise softmax(logits / temperature) sampling, optionally from
the top-k tokens only. The prompt follows an EOS token, as a document does in training.
Bad options and refused checkpoints exit with code 2, as train.py does.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from data.quiet_imports import quiet_library_noise
from model.gpt import GPT
from scripts.refuse import BAD_INPUT

# Takes the tokens not yet seen by the model [B, T] and returns the logits that follow the
# last of them [B, V]; it keeps whatever state (KV cache, or the whole sequence) it needs.
Step = Callable[[torch.Tensor], torch.Tensor]


def gpt_step(model: GPT, use_cache: bool = True) -> Step:
    """Our model, decoding with its KV cache, or (use_cache=False) recomputing every position."""
    cache = model.new_cache() if use_cache else None
    seen: list[torch.Tensor] = []

    def step(new: torch.Tensor) -> torch.Tensor:
        if cache is not None:
            return model(new, cache=cache)[:, -1]
        seen.append(new)
        return model(torch.cat(seen, dim=1))[:, -1]

    return step


def cache_argument(model) -> str:
    """The name `model.forward` takes its KV cache by: `cache` since transformers renamed it
    (`past_key_values` then warns that it goes in 5.40), `past_key_values` in the earlier 5.x
    releases requirements.txt allows, whose **kwargs would swallow `cache` unread."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_step(model) -> Step:
    """A transformers causal LM, decoding with its own cache."""
    from transformers import DynamicCache

    cache = {cache_argument(model): DynamicCache(config=model.config)}

    def step(new: torch.Tensor) -> torch.Tensor:
        return model(input_ids=new, use_cache=True, **cache).logits[:, -1]

    return step


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """`prompt`'s token ids after the EOS token, as training saw a document start: after the
    EOS ending the one before. Added here, and the tokenizer's own special tokens left out: an
    export's tokenizer adds that EOS itself (scripts/export_hf.py) and a run's does not, so
    this gives it once from either."""
    return [tokenizer.eos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)


def next_token(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[B, 1] next tokens: argmax when temperature is 0, else a sample."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


@torch.no_grad()
def generate(
    step: Step,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: Optional[int] = None,
    seed: int = 0,
) -> torch.Tensor:
    """prompt [B, T] followed by up to `max_new_tokens` tokens; stops early once every row
    has produced `eos_id`."""
    generator = torch.Generator().manual_seed(seed)
    tokens, new = prompt, prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        new = next_token(step(new), temperature, top_k, generator)
        tokens = torch.cat([tokens, new], dim=1)
        if eos_id is not None:
            done |= new[:, 0] == eos_id
            if done.all():
                break
    return tokens


def load_source(source: Path, device: torch.device, allow_suspect: bool = False) -> tuple[Step, object, int]:
    """(step function, tokenizer, longest sequence) for a checkpoint or an exported dir."""
    if (source / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source).to(device).eval()
        return hf_step(model), AutoTokenizer.from_pretrained(source), model.config.max_position_embeddings

    from model.hf_export import gpt_from_tensors
    from scripts.export_hf import load_run, run_tokenizer

    cfg, tensors, config = load_run(source, allow_suspect)
    model = gpt_from_tensors(cfg, tensors).to(device).eval()
    return gpt_step(model), run_tokenizer(config, source=source), cfg.max_seq_len


def main(argv: Optional[list[str]] = None) -> int:
    # transformers' models import torchao, whose import prints lines that are not news here
    quiet_library_noise()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="checkpoint file / run dir, or an exported directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0 = all)")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--allow-suspect", action="store_true", help="sample from a checkpoint saved after a "
                        "non-finite step (listed in checkpoints/suspect.json) all the same")
    args = parser.parse_args(argv)
    for flag, value, minimum in (("--max-new-tokens", args.max_new_tokens, 1), ("--num-samples", args.num_samples, 1),
                                 ("--top-k", args.top_k, 0), ("--temperature", args.temperature, 0)):
        if not value >= minimum:  # before the checkpoint is read
            print(f"error: {flag} must be >= {minimum}, got {value}", file=sys.stderr)
            return BAD_INPUT
    from trainer.checkpoint.files import CheckpointError

    device = torch.device(args.device)
    try:
        step, tokenizer, max_len = load_source(args.source, device, args.allow_suspect)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    ids = prompt_ids(tokenizer, args.prompt)
    if len(ids) >= max_len:
        print(f"error: --prompt is {len(ids)} tokens; the model takes at most {max_len}", file=sys.stderr)
        return BAD_INPUT
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    out = generate(step, prompt, min(args.max_new_tokens, max_len - len(ids)), args.temperature,
                   args.top_k, tokenizer.eos_token_id, args.seed)
    for i, row in enumerate(out[:, 1:].tolist()):
        if tokenizer.eos_token_id in row[len(ids) - 1 :]:
            row = row[: row.index(tokenizer.eos_token_id, len(ids) - 1)]
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tokenizer.decode(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
