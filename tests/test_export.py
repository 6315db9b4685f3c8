"""Export to Hugging Face transformers: the exported model computes what ours computes.

Models get random weights of a realistic scale, random norm gammas and (for MoE) a non-zero
expert selection bias, so a mis-mapped tensor, eps, RoPE setting or routing rule shows up
as a logit difference far above the 1e-4 tolerance.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from data.tokenizer import EOS_TOKEN, train_bpe
from model.config import ModelConfig
from model.gpt import GPT
from model.hf_export import ExportError, architecture, export
from model.moe import MoE
from scripts import export_hf
from tests.conftest import compose
from tests.distributed import run_distributed
from tests.closeness import assert_close, check
from trainer.config import to_dataclass

TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    text = "def forward(self, x):\n    return self.proj(x) + 1  # the residual\n"
    bpe = train_bpe([text] * 8, vocab_size=320)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, clean_up_tokenization_spaces=False)


def preset(name: str, vocab_size: int, **overrides) -> ModelConfig:
    """A conf/model preset, as train.py composes it."""
    cfg = to_dataclass(compose([f"model={name}"])).model
    return dataclasses.replace(cfg, vocab_size=vocab_size, **overrides)


def random_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Every parameter random (gammas around 1, matrices std 0.1) and random expert biases."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if param.ndim == 1 else 0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


def export_and_load(model: GPT, tokenizer, out_dir: Path):
    arch = export(model.cfg, model.state_dict(), tokenizer, out_dir)
    hf = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert type(hf).__name__ == arch
    return hf


def max_logit_diff(model: GPT, hf, vocab: int, seq: int = 48) -> float:
    idx = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert theirs.dtype == torch.float32
    assert ours.std() > 0.5  # peaked enough that a wrong mapping could not hide under TOL
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize("overrides, arch", [
    ({}, "LlamaForCausalLM"),  # gpt_tiny: GQA, 4 query heads over 2 kv heads
    ({"n_kv_heads": 4, "rope_theta": 5000.0, "norm_eps": 1e-6}, "LlamaForCausalLM"),
    ({"qk_norm": True}, "Qwen3ForCausalLM"),
])
def test_dense_export_logits_equal_ours(tmp_path, tokenizer, overrides, arch):
    cfg = preset("gpt_tiny", len(tokenizer), **overrides)
    model = random_model(cfg)
    hf = export_and_load(model, tokenizer, tmp_path)
    assert type(hf).__name__ == arch
    c = hf.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    assert c.rope_parameters["rope_theta"] == cfg.rope_theta and c.rms_norm_eps == cfg.norm_eps
    assert c.tie_word_embeddings is False
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    diff = max_logit_diff(model, hf, cfg.vocab_size)
    assert diff <= TOL, diff


def bias_changes_selection(model: GPT, vocab: int) -> bool:
    """Whether the expert bias changes which experts some token is routed to."""
    layer = next(b.mlp for b in model.blocks if isinstance(b.mlp, MoE))
    x = model.embed(torch.randint(0, vocab, (64,)))
    with torch.no_grad():
        biased = layer.route(x)[0].sort(-1).values
        bias = layer.expert_bias.clone()
        layer.expert_bias.zero_()
        unbiased = layer.route(x)[0].sort(-1).values
        layer.expert_bias.copy_(bias)
    return not torch.equal(biased, unbiased)


# transformers builds Glm4Moe's (here empty) shared expert and torch notes its init is a no-op.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("overrides", [
    {"routed_scaling": 2.5},  # moe_tiny: 1 shared expert, first layer dense
    {"n_shared_experts": 0, "n_dense_layers": 0, "qk_norm": True, "top_k": 3},
])
def test_moe_export_to_glm4_moe_logits_equal_ours(tmp_path, tokenizer, overrides):
    cfg = preset("moe_tiny", len(tokenizer), **overrides)
    model = random_model(cfg)
    assert bias_changes_selection(model, cfg.vocab_size)
    hf = export_and_load(model, tokenizer, tmp_path)
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    c = hf.config
    assert (c.n_routed_experts, c.num_experts_per_tok, c.first_k_dense_replace) == (4, cfg.top_k, cfg.n_dense_layers)
    assert (c.n_group, c.topk_group, c.norm_topk_prob) == (1, 1, True)
    assert c.routed_scaling_factor == cfg.routed_scaling
    assert c.rope_parameters["partial_rotary_factor"] == 1.0  # Glm4Moe's default is 0.5
    bias = hf.model.layers[cfg.n_layers - 1].mlp.gate.e_score_correction_bias
    assert_close(bias, model.blocks[-1].mlp.expert_bias, rtol=0, atol=0)
    diff = max_logit_diff(model, hf, cfg.vocab_size)
    assert diff <= TOL, diff


def test_softmax_moe_is_refused_naming_the_nearest_architectures(tmp_path, tokenizer):
    cfg = preset("moe_tiny", len(tokenizer), score_func="softmax")
    with pytest.raises(ExportError, match="score_func=softmax") as err:
        export(cfg, GPT(cfg).state_dict(), tokenizer, tmp_path)
    assert "Ernie4_5_Moe" in str(err.value) and "renormalises" in str(err.value)
    assert not (tmp_path / "config.json").exists()


def test_export_writes_safetensors_and_a_loadable_tokenizer(tmp_path, tokenizer):
    cfg = preset("gpt_tiny", len(tokenizer))
    model = random_model(cfg)
    assert architecture(cfg) == "LlamaForCausalLM"
    export(cfg, model.state_dict(), tokenizer, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert_close(weights["model.layers.1.self_attn.k_proj.weight"],
                               model.blocks[1].attn.wk.weight, rtol=0, atol=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == tokenizer.eos_token_id
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "def forward(self, y):  return y\n"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.eos_token == EOS_TOKEN and len(loaded) == cfg.vocab_size
    # Before: model.safetensors alone came out 0600, unreadable to anyone else.
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_tokenizer_of_another_vocabulary_is_refused(tmp_path, tokenizer):
    cfg = preset("gpt_tiny", len(tokenizer) + 1)
    with pytest.raises(ExportError, match="tokenizer has"):
        export(cfg, GPT(cfg).state_dict(), tokenizer, tmp_path)


def test_missing_checkpoint_is_one_line_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "run" / "step_00000010.pt"
    assert export_hf.main([str(missing), str(tmp_path / "out")]) == 2  # bad input, as train.py
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "no such checkpoint" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("own_template", [False, True], ids=["plain", "with-its-own-bos"])
def test_the_exported_tokenizer_starts_every_text_with_eos_as_training_did(tmp_path, tokenizer, own_template):
    """Before: AutoTokenizer on an export encoded a prompt without the EOS that starts every
    training document, so plain transformers prompted the model unlike training."""
    text = "def forward(self, y):  return y\n"
    plain = tokenizer.encode(text, add_special_tokens=False)
    source = tokenizer
    if own_template:  # a pretrained tokenizer that adds a BOS of its own: training left it out
        source = copy.deepcopy(tokenizer)
        bos = source.convert_ids_to_tokens(plain[0])
        source.backend_tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, plain[0])])
        assert source.encode(text) == [plain[0]] + plain
    before = source.encode(text)
    with_start = export_hf.document_start_tokenizer(source)
    assert source.encode(text) == before  # the run's tokenizer encodes as training did
    cfg = preset("gpt_tiny", len(tokenizer))
    export(cfg, GPT(cfg).state_dict(), with_start, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    eos = tokenizer.eos_token_id
    assert loaded(text)["input_ids"] == [eos] + plain
    assert loaded(text, return_tensors="pt")["input_ids"].tolist() == [[eos] + plain]
    assert loaded(text, add_special_tokens=False)["input_ids"] == plain
    assert (loaded.bos_token, loaded.bos_token_id) == (EOS_TOKEN, eos)
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


# ---- from real training checkpoints: TP=2 and ZeRO (DP=2) export like TP=1 ----

TRAIN = [
    "model=gpt_tiny", "optim=muon", "optim.muon.ns_dtype=fp32", "trainer.precision=fp32",
    "trainer.device=cpu", "trainer.max_steps=2", "trainer.seq_len=32", "trainer.batch_size=2", "eval.interval=0",
    "eval.batches=1", "logger.interval=1", "logger.wandb.mode=disabled", "logger.tensorboard=false",
    "logger.progress=none", "checkpoint.interval=0",
]


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 2), "dp2": (2, 1)}  # name: (world size, TP)


def train_run(run_dir: Path, tp: int, mesh=None) -> None:
    """Two training steps in this layout (the same global batch in each), then a checkpoint."""
    from trainer.loop import Trainer

    dp = 1 if mesh is None else mesh.dp
    cfg = to_dataclass(compose(TRAIN + [f"parallel.tp={tp}", f"trainer.batch_size={2 // dp}"]))
    Trainer(cfg, run_dir, mesh).train()


def train_two_process_layouts(rank: int, world: int, root: str) -> None:
    """Both two-process layouts in one spawn: starting processes costs more than training."""
    from parallel.mesh import build_mesh

    for name, (size, tp) in LAYOUTS.items():
        if size == world:
            train_run(Path(root) / name, tp, build_mesh(tp))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run dirs of the same training in three layouts: single process, TP=2, DP=2 (ZeRO-1)."""
    root = tmp_path_factory.mktemp("runs")
    train_run(root / "tp1", tp=1)
    run_distributed(train_two_process_layouts, 2, str(root))
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_export_of_a_sharded_run_equals_the_single_process_one(tmp_path, runs, layout):
    from trainer.checkpoint import files as checkpoint_files

    saved = checkpoint_files.load(runs[layout] / "checkpoints" / "step_00000002")
    assert saved["mesh"] == ({"dp": 1, "tp": 2} if layout == "tp2" else {"dp": 2, "tp": 1})
    for name in ("tp1", layout):
        assert export_hf.main([str(runs[name]), str(tmp_path / name)]) == 0
    reference = load_file(tmp_path / "tp1" / "model.safetensors")
    exported = load_file(tmp_path / layout / "model.safetensors")
    assert set(exported) == set(reference)
    worst = max((exported[k] - reference[k]).abs().max().item() for k in reference)
    check("worst logit difference", worst, 1e-6)
    # the run's own tokenizer went with it
    ours = export_hf.run_tokenizer(saved["config"])
    theirs = AutoTokenizer.from_pretrained(tmp_path / layout)
    assert theirs.encode("import os\n", add_special_tokens=False) == ours.encode("import os\n")


def test_a_run_dir_is_self_contained_export_works_from_anywhere(tmp_path, runs, monkeypatch):
    """Before: export read the tokenizer from data.cache_dir, relative to where train.py ran,
    so it failed from any other directory. Now the run dir holds a copy."""
    copy = runs["tp1"] / "tokenizer"
    assert (copy / "tokenizer.json").is_file()
    monkeypatch.chdir(tmp_path)  # nowhere near the run's data cache
    assert export_hf.main([str(runs["tp1"]), str(tmp_path / "hf")]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    in_run = AutoTokenizer.from_pretrained(copy)
    text = "def f(x):\n    return x  # ünïcödé\n"
    assert exported.encode(text, add_special_tokens=False) == in_run.encode(text, add_special_tokens=False)
    assert exported.get_vocab() == in_run.get_vocab()


# Our own calls into transformers must use the arguments it documents now: a deprecated one
# (`past_key_values`, which warns it goes in 5.40) fails these tests before it fails users.
@pytest.mark.filterwarnings("error::FutureWarning")
def test_generate_prints_the_same_greedy_text_from_the_checkpoint_and_the_export(tmp_path, runs, capsys):
    from scripts import generate

    assert export_hf.main([str(runs["tp1"]), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    args = ["--prompt", "def ", "--max-new-tokens", "12"]
    assert generate.main([str(runs["tp1"]), *args]) == 0
    ours = capsys.readouterr().out
    assert generate.main([str(tmp_path / "hf"), *args]) == 0
    theirs = capsys.readouterr().out
    assert ours == theirs
    assert ours.startswith("def ") and len(ours) > len("def \n")


@pytest.mark.filterwarnings("error::FutureWarning")
def test_generate_and_plain_transformers_give_the_same_greedy_tokens(tmp_path, runs):
    """Before: the exported tokenizer left out the EOS that starts every training document, so
    `AutoTokenizer` + `generate()` prompted the model otherwise than generate.py did."""
    from scripts import generate

    out = tmp_path / "hf"
    assert export_hf.main([str(runs["tp1"]), str(out)]) == 0
    prompt, n = "def ", 12
    tok = AutoTokenizer.from_pretrained(out)
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).generate(**inputs, max_new_tokens=n, do_sample=False)
    assert theirs.shape[1] > inputs["input_ids"].shape[1]
    for source in (runs["tp1"], out):  # our model with its KV cache; the export through generate.py
        step, tokenizer, _ = generate.load_source(source, torch.device("cpu"))
        ids = generate.prompt_ids(tokenizer, prompt)
        eos = tokenizer.eos_token_id
        assert ids == [eos] + tokenizer.encode(prompt, add_special_tokens=False)  # EOS once, not twice
        assert ids == inputs["input_ids"][0].tolist()
        ours = generate.generate(step, torch.tensor([ids]), n, eos_id=eos)
        assert ours.tolist() == theirs.tolist()


def test_export_and_generate_from_a_checkpoint_show_no_warning(tmp_path, runs, capsys):
    """Before: both printed torch.distributed.checkpoint's "torch.distributed is disabled,
    unavailable or uninitialized" UserWarning, which only looks like something went wrong."""
    from scripts import generate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert export_hf.main([str(runs["tp1"]), str(tmp_path / "hf")]) == 0
        assert generate.main([str(runs["tp1"]), "--prompt", "def ", "--max-new-tokens", "2"]) == 0
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert "Warning" not in capsys.readouterr().err


# What importing torchao printed first (transformers' Llama imports it): CUDA kernel libraries a
# CPU build of torch cannot load, and torch's note on the enums torchao registers the old way.
IMPORT_NOISE = ("Failed to load", "register_constant()")


def test_export_and_generate_print_none_of_torchaos_import_noise(tmp_path, runs):
    """Each script in a process of its own (forked before torchao was imported): the import
    happens once per process, so only there would its lines show. Side by side, generate.py
    sampling from an export made here."""
    from tests.prestarted import start_python

    cfg, tensors, config = export_hf.load_run(runs["tp1"])
    export(cfg, tensors, export_hf.run_tokenizer(config, source=runs["tp1"]), tmp_path / "here")
    procs = [start_python(["scripts/export_hf.py", str(runs["tp1"]), str(tmp_path / "hf")]),
             start_python(["scripts/generate.py", str(tmp_path / "here"), "--max-new-tokens", "1"])]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert [line for line in err.splitlines() if any(n in line for n in IMPORT_NOISE)] == []


def test_a_suspect_checkpoint_is_refused_with_exit_2_in_one_line(tmp_path, runs, capsys):
    """Before: export_hf.py and generate.py exited 1 on it, train.py 2; now every refusal is 2."""
    from scripts import generate
    from trainer.checkpoint import files as checkpoint_files

    run = tmp_path / "run"
    shutil.copytree(runs["tp1"], run)
    checkpoint_files.set_suspect(run / "checkpoints", "step_00000002", "a test's reason")
    suspect = run / "checkpoints" / "step_00000002"
    capsys.readouterr()
    for source, says in ((suspect, "a test's reason"), (run, "no checkpoint is known good")):
        assert export_hf.main([str(source), str(tmp_path / "hf")]) == 2
        assert generate.main([str(source), "--prompt", "def "]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2 and all(says in line and "--allow-suspect" in line for line in lines), lines
    assert not (tmp_path / "hf").exists()
    assert export_hf.main([str(suspect), str(tmp_path / "hf"), "--allow-suspect"]) == 0
