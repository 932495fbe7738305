"""Train the small minimind-3 model committed as tests/fixtures/minimind-3-stdlib: a trained model to judge
quantization quality on, since random weights say little about a real model (a nearly uniform next-token
distribution flips its top token at any perturbation).

    python benchmarks/train_fixture.py [--out tests/fixtures/minimind-3-stdlib] [--steps 400] [--threads 2]

The text is the one every machine has: the Python standard library's own top-level modules (Lib/*.py, sorted by
name). Every 16th file (sorted index 8, 24, ...) is held out; the rest train a byte-level BPE tokenizer
(`tokenizers`, 2048 ids, MiniMind's special tokens at MiniMind's ids) and the model (hidden 128, 4 layers, 4 heads,
2 kv heads: ~1.15M parameters), on random 128-token windows drawn from one seeded generator, with AdamW and a cosine
schedule. The stdlib differs between Python patch versions, so fixture.json records the version, every file used
(name and sha256) and the corpus's sha256: the same version and seed give the same corpus, tokenizer and batches;
the weights are the same on the same torch build and thread count (float reductions depend on both).

The folder is what `export-onnx export --checkpoint DIR` reads (config.json of model_type "minimind" +
model.safetensors, the weights stored in float16 to halve the fixture, the tied lm_head once), plus tokenizer.json,
tokenizer_config.json, heldout.txt (a ~4 KB slice of the held-out modules, for perplexity) and fixture.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference import MiniMindConfig, build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "minimind-3-stdlib"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # MiniMind's ids: bos 1, eos 2
HELD_OUT_EVERY, HELD_OUT_AT = 16, 8
HELDOUT_BYTES = 4096
CONFIG = MiniMindConfig(
    vocab_size=2048,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,  # the training window: positions past it were never seen
)
SEQ_LEN, BATCH = 128, 16  # 128-token windows train ~1.5x faster per token on the CPU than 256
PEAK_LR, MIN_LR, WARMUP, WEIGHT_DECAY = 3e-3, 3e-4, 20, 0.1
EVAL_WINDOWS = 32


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the stdlib's top-level modules, sorted by name."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_AT]
    return [f for f in files if f not in held], held


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_bytes().decode("utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE of CONFIG.vocab_size ids: the 3 special tokens, all 256 byte symbols, then merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Every file's ids, each followed by eos (the model learns where a module ends)."""
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(CONFIG.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def training_init_(model: torch.nn.Module, seed: int) -> None:
    """GPT-2's initialisation (reference.init's seeded weights are for verification: std 0.1, norms off one):
    linear and embedding weights N(0, 0.02), output projections scaled by 1/sqrt(2 layers), norms one."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * CONFIG.num_hidden_layers)
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else 0.02
                )
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            else:
                param.zero_()


def learning_rate(step: int, steps: int) -> float:
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1 + math.cos(math.pi * progress))


def windows(stream: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - SEQ_LEN, (count,), generator=generator)
    return torch.stack([stream[s : s + SEQ_LEN] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model, batches: torch.Tensor) -> float:
    model.eval()
    losses = [model(chunk, labels=chunk).loss.item() for chunk in batches.split(8)]
    model.train()
    return sum(losses) / len(losses)


def heldout_slice(texts: list[str]) -> str:
    """About HELDOUT_BYTES of the first held-out module, from its first `def`/`class` line, cut at a line end."""
    text = texts[0]
    start = min(i for i in (text.find("\ndef "), text.find("\nclass ")) if i >= 0) + 1
    piece = text[start : start + HELDOUT_BYTES]
    return piece[: piece.rfind("\n") + 1]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the fixture folder (replaced)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of BATCH x SEQ_LEN tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the weights depend on it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()

    train_files, held_files = corpus_files()
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tokenizer = train_tokenizer(train_texts)
    assert tokenizer.get_vocab_size() == CONFIG.vocab_size, tokenizer.get_vocab_size()
    train_ids, held_ids = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_texts)
    print(
        f"corpus: {len(train_files)} training modules ({len(train_ids):,} tokens), {len(held_files)} held out "
        f"({len(held_ids):,} tokens); tokenizer {time.time() - started:.1f} s",
        flush=True,
    )

    model = build_model(CONFIG, seed=args.seed).train()
    training_init_(model, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )
    data = torch.Generator().manual_seed(args.seed)
    evaluation = torch.Generator().manual_seed(args.seed + 1)
    train_eval, held_eval = windows(train_ids, EVAL_WINDOWS, evaluation), windows(held_ids, EVAL_WINDOWS, evaluation)
    print(f"model: {parameters:,} parameters; loss at init ~ln {CONFIG.vocab_size} = {math.log(CONFIG.vocab_size):.2f}")

    train_start = time.time()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps)
        batch = windows(train_ids, BATCH, data)
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.steps - 1:
            rate = (step + 1) * BATCH * SEQ_LEN / (time.time() - train_start)
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {learning_rate(step, args.steps):.2e}  {rate:.0f} tok/s")
            sys.stdout.flush()
    train_seconds = time.time() - train_start

    # The fixture holds float16 weights: the model it defines is the rounded one, so it is evaluated rounded.
    model.eval()
    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(param.half().float())
    train_loss, held_loss = mean_loss(model, train_eval), mean_loss(model, held_eval)
    print(
        f"done in {train_seconds:.0f} s of training ({time.time() - started:.0f} s in all): "
        f"train loss {train_loss:.3f}, held-out loss {held_loss:.3f} "
        f"(perplexity {math.exp(held_loss):.1f} on a {CONFIG.vocab_size}-id vocabulary)"
    )

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "minimind", **CONFIG.to_dict()}, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[CONFIG.bos_token_id],
        "eos_token": SPECIAL_TOKENS[CONFIG.eos_token_id],
        "unk_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": CONFIG.max_position_embeddings,
        "add_bos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    heldout = heldout_slice(held_texts)
    (out / "heldout.txt").write_text(heldout)
    corpus = b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in train_files)
    metadata = {
        "what": "minimind-3 trained on the Python standard library's top-level modules (benchmarks/train_fixture.py)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "seed": args.seed,
        "steps": args.steps,
        "batch": BATCH,
        "sequence_length": SEQ_LEN,
        "tokens_seen": args.steps * BATCH * SEQ_LEN,
        "learning_rate": {"peak": PEAK_LR, "min": MIN_LR, "warmup": WARMUP, "weight_decay": WEIGHT_DECAY},
        "parameters": parameters,
        "weights_dtype": "float16",
        "train_seconds": round(train_seconds, 1),
        "train_loss": round(train_loss, 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_perplexity": round(math.exp(held_loss), 2),
        "loss_windows": f"{EVAL_WINDOWS} windows of {SEQ_LEN} tokens each, float16 weights",
        "corpus_sha256": sha256(corpus),
        "corpus_tokens": len(train_ids),
        "held_out_rule": f"sorted index % {HELD_OUT_EVERY} == {HELD_OUT_AT}",
        "heldout_txt": f"{HELDOUT_BYTES} bytes or less of {held_files[0].name}, from its first def/class line",
        "held_out_files": {f.name: sha256(f.read_bytes()) for f in held_files},
        "training_files": {f.name: sha256(f.read_bytes()) for f in train_files},
    }
    (out / "fixture.json").write_text(json.dumps(metadata, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
