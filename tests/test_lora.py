"""LoRA (train.lora): adapters trained on a frozen base, proven against peft on the same base and
adapters, exported merged and as PEFT's adapter, the same on a sharded mesh as on one device."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.models import lora
from podtrain.planning import plan, targets
from podtrain.program import adapters, sampler
from podtrain.program.checks import resolve_auto
from podtrain.program.job import build
from podtrain.program.load import load_config
from podtrain.program.state import weights
from podtrain.runtime import chips
from podtrain.runtime.mesh import build_mesh
from podtrain.train.checkpoint import Checkpointer
from podtrain.train.loop import train
from podtrain.train.run import Run, starting_weights

from helpers import needs_cuda_compiler
from test_hf import TOKENS, hf_llama, podtrain_logits, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=[q_proj,v_proj,o_proj,gate_proj,down_proj]"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random transformers Llama (untied head), imported as a run, and a text corpus."""
    root = tmp_path_factory.mktemp("lora")
    hf_llama(root / "hf", tie_word_embeddings=False)
    (root / "corpus.txt").write_text("".join(f"{i} + {i} = {2 * i}. " for i in range(2000)))
    args = ["convert", "--from-hf", str(root / "hf"), str(root / "run"), "train.seq_len=32", "train.batch_size=8"]
    assert (
        main([*args, "device_type=cpu", "data.source=text", "data.format=text", f"data.path={root / 'corpus.txt'}"])
        == 0
    )
    return root


def agree(logits, reference) -> bool:
    """Equal to float32 rounding: within 1e-5 of the logits' scale (about 3 here). transformers and
    podtrain differ by 1.2e-5 on the base alone; x W + (x A) B and x (W + A B) round apart as much."""
    return np.abs(logits - reference).max() < 1e-5 * np.abs(reference).max()


def overrides(root, run_dir, *extra):
    return [
        "data.source=text",
        "data.format=text",
        f"data.path={root / 'corpus.txt'}",
        f"train.init_from={root / 'hf'}",
        f"run_dir={run_dir}",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "train.warmup_steps=0",
        "train.lr=2e-2",
        *LORA,
        *extra,
    ]


def test_adapters_train_alone_and_match_peft_merged_or_not(base, capsys):
    cfg = load_config(base / "run" / "config.yaml", overrides(base, base / "lora", "train.steps=6"))
    train(cfg)
    assert "trained: LoRA rank 4 on q_proj, v_proj, o_proj, gate_proj, down_proj" in capsys.readouterr().out

    # The checkpoint keeps the adapters and their optimizer state, nothing of the base.
    checkpointer = Checkpointer(base / "lora" / "checkpoints")
    saved = checkpointer.manager.item_metadata(6)
    names = {
        "/".join(str(getattr(k, "key", k)) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(
            saved["params"].tree if hasattr(saved["params"], "tree") else saved["params"]
        )[0]
    }
    checkpointer.close()
    assert names and all("/lora_w" in name for name in names), names
    assert {n.split("/")[-2] for n in names} == {"lora_wq", "lora_wv", "lora_wo", "lora_w_gate", "lora_w_down"}
    job = build(resolve_auto(cfg, "cpu"), build_mesh(cfg.mesh, jax.devices()[:1]), data=False)
    adapter_shapes = {s.shape for s in jax.tree.leaves(job.abstract_state["params"])}
    assert {s.shape for s in jax.tree.leaves(job.abstract_state["opt"]) if s.ndim} <= adapter_shapes

    # The base is the imported weights, bit for bit; the adapters moved away from B = 0.
    _, fns, params = Run.at(base / "lora").language_model()
    trained, frozen = lora.split(params)
    _, _, imported = Run.at(base / "run").language_model()
    for got, want in zip(jax.tree.leaves(frozen), jax.tree.leaves(imported), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    assert all(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(trained))

    ours = podtrain_logits(base / "lora", TOKENS)
    assert (
        main(["convert", "--to-hf", str(base / "lora"), str(base / "adapter"), "--adapter", "--dtype", "float32"]) == 0
    )
    hf_base = transformers.LlamaForCausalLM.from_pretrained(base / "hf", dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf_base, base / "adapter").eval()
    assert agree(torch_logits(with_adapter, TOKENS), ours)
    prompt = TOKENS[0, :7].tolist()  # the sampler decodes with the adapters, greedy as peft's model
    with torch.no_grad():
        theirs = with_adapter.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert (
        sampler.generate(fns, params, [prompt], 12, max_len=cfg.model.max_seq_len)[0].tokens == theirs[0, 7:].tolist()
    )
    plain = transformers.LlamaForCausalLM.from_pretrained(base / "hf", dtype=torch.float32).eval()
    assert np.abs(torch_logits(plain, TOKENS) - ours).max() > 1e-3  # the adapters change the model

    assert main(["convert", "--to-hf", str(base / "lora"), str(base / "merged"), "--dtype", "float32"]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(base / "merged", dtype=torch.float32).eval()
    assert agree(torch_logits(merged, TOKENS), torch_logits(with_adapter, TOKENS))
    data = ["data.source=text", "data.format=text", f"data.path={base / 'corpus.txt'}"]
    assert main(["convert", "--from-hf", str(base / "merged"), str(base / "merged_run"), "device_type=cpu", *data]) == 0
    assert agree(podtrain_logits(base / "merged_run", TOKENS), ours)

    # The run's config names the base its adapters were trained on; resuming on another is refused.
    other = overrides(base, base / "lora", "train.steps=8", f"train.init_from={base / 'run'}")
    capsys.readouterr()
    assert main(["train", str(base / "run" / "config.yaml"), *other]) == 2
    assert "were trained on train.init_from=" in capsys.readouterr().err


def test_sharded_adapters_train_as_on_one_device(base):
    results = []
    for mesh in (["mesh.data=1"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]):
        cfg = resolve_auto(load_config(base / "run" / "config.yaml", overrides(base, base / "unused", *mesh)), "cpu")
        devices = jax.devices()[: cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor]
        job = build(cfg, build_mesh(cfg.mesh, devices))
        state = job.init_state(cfg.seed, starting_weights(cfg.train.init_from, job.setup.abstract_start, cfg))
        losses = []
        for i in range(3):
            state, metrics = job.step(state, job.task.batches[i])
            losses.append(float(metrics["loss"]))
        results.append((np.array(losses), jax.device_get(state["params"])))
    (one, one_params), (sharded, sharded_params) = results
    np.testing.assert_allclose(sharded, one, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_lora_needs_a_base_and_known_projections(base, capsys):
    run = str(base / "run" / "config.yaml")
    assert main(["train", run, "train.lora.rank=4", f"run_dir={base / 'nobase'}"]) == 2
    assert "set train.init_from" in capsys.readouterr().err
    bad = ["train", run, "train.lora.rank=4", f"train.init_from={base / 'hf'}", "train.lora.targets=[qkv]"]
    assert main([*bad, f"run_dir={base / 'badtarget'}"]) == 2
    assert "qkv is not a projection LoRA adapts" in capsys.readouterr().err


def test_merging_adds_the_scaled_product_to_each_layer():
    rng = np.random.default_rng(0)
    w, a, b = rng.normal(size=(3, 4, 2, 5)), rng.normal(size=(3, 4, 6)), rng.normal(size=(3, 6, 2, 5))
    params = {"layers": {"attn": {"wq": w, "lora_wq": {"a": a, "b": b}, "wk": w}}}
    out = adapters.merged(params, 0.5)
    assert set(out["layers"]["attn"]) == {"wq", "wk"}
    want = w + 0.5 * np.einsum("lir,lrhk->lihk", a, b)
    np.testing.assert_allclose(out["layers"]["attn"]["wq"], want, atol=1e-5)
    assert np.array_equal(out["layers"]["attn"]["wk"], w)
    assert lora.union(*lora.split(params)[::-1]) == params


def test_dropout_draws_new_masks_each_step_and_none_in_evaluation(base):
    results = {}
    for rate in (0.0, 0.5):
        cfg = load_config(base / "run" / "config.yaml", overrides(base, base / "unused", f"train.lora.dropout={rate}"))
        cfg = resolve_auto(cfg, "cpu")
        job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
        state = job.init_state(cfg.seed, starting_weights(cfg.train.init_from, job.setup.abstract_start, cfg))
        # B = 0 at the start hides the adapters' input: give them a value first
        state["params"] = jax.tree.map(lambda x: x + 0.05, state["params"])
        evaluated = job.evaluate(weights(state))["val_loss"]
        losses = [float(job.step(jax.tree.map(jnp.copy, state), job.task.batches[0])[1]["loss"]) for _ in range(2)]
        state["step"] = state["step"] + 1  # another step's key
        losses.append(float(job.step(state, job.task.batches[0])[1]["loss"]))
        results[rate] = evaluated, losses
    assert results[0.5][0] == results[0.0][0]  # no dropout in evaluation
    assert results[0.0][1][0] == results[0.0][1][1] == results[0.0][1][2]
    dropped = results[0.5][1]
    assert dropped[0] == dropped[1] != dropped[2]  # the same step draws the same masks, the next new ones
    assert dropped[0] != results[0.0][1][0]


def test_a_bfloat16_base_from_a_run_directory(base):
    extra = ["model.compute_dtype=bfloat16", f"train.init_from={base / 'run'}", "train.steps=2"]
    last = train(load_config(base / "run" / "config.yaml", overrides(base, base / "bf16", *extra)))
    assert np.isfinite(last["loss"])
    cfg = resolve_auto(load_config(base / "run" / "config.yaml", overrides(base, base / "bf16", *extra)), "cpu")
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]), data=False)
    assert {s.dtype for s in jax.tree.leaves(job.abstract_state["base"])} == {jnp.dtype("bfloat16")}
    assert {s.dtype for s in jax.tree.leaves(job.abstract_state["params"])} == {jnp.dtype("float32")}


@pytest.mark.integration
@needs_cuda_compiler
def test_an_8b_lora_fine_tune_fits_one_h100_where_the_full_one_does_not():
    """`plan --target h100` of configs/sft_llama3_8b_lora.yaml, compiled for the card with no GPU
    here: 45.0 GiB of 59.4 (the base 15 GiB in bfloat16); the full fine-tune's state alone is 120 GiB."""
    recipe = Path(__file__).parent.parent / "configs" / "sft_llama3_8b_lora.yaml"
    lora = plan.plan(load_config(recipe), targets.target("h100"))
    assert lora.fits and lora.memory.total / chips.GiB == pytest.approx(45.0, rel=0.1)
    full = plan.plan(load_config(recipe, ["train.lora.rank=0"]), targets.target("h100"), remedy=False)
    assert not full.fits and full.memory.total / chips.GiB > 110


def test_an_moe_adapts_attention_and_dense_layers_not_its_experts(small_overrides):
    cfg = load_config(None, [*small_overrides, "model.name=moe", "train.lora.rank=4", "train.init_from=a_base"])
    job = build(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    leaves = jax.tree_util.tree_flatten_with_path(job.abstract_state["params"])[0]
    adapted = {"/".join(str(k.key) for k in path[:-1]) for path, _ in leaves}
    assert adapted and all("/attn/" in name or "dense" in name for name in adapted), adapted
    state, metrics = job.step(job.init_state(cfg.seed), job.task.batches[0])  # a random base
    assert np.isfinite(float(metrics["loss"]))
