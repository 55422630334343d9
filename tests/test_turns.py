"""Turns that end: the chat template's end-of-turn token is a stop token of the tokenizer podtrain
fits, of `generate` and of the exported generation_config (a source model's eos list, bos and pad
kept through import, fine-tuning and export); an imported run is set up for chat fine-tuning."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from podtrain.cli import main
from podtrain.data import chat
from podtrain.data.tokenizer import CHAT_TOKENS, EOS, fit_bpe, load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import hf_llama  # noqa: E402

CHAT_FILE = Path(__file__).parent.parent / "configs" / "data" / "chat_tiny.jsonl"
MESSAGE = "What is 2 + 3?"
# A source model's token ids as SmolLM2-Instruct's: <|im_end|> (2) and <|endoftext|> (0) end a
# generation, <|im_start|> (1) is bos, <|endoftext|> pads.
SOURCE_IDS = {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """ChatML's tokens first: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2."""
    lines = CHAT_FILE.read_text().splitlines()[:200]
    text = " ".join(m["content"] for line in lines for m in json.loads(line)["messages"])
    fitted = fit_bpe([text + " user assistant system" * 10] * 3, 300, tmp_path_factory.mktemp("tok"), chat=True)
    assert fitted.vocab_size == 300  # the model's vocabulary: its greedy picks are the tokenizer's
    return fitted


def _with_template(tokenizer, template: str, folder: Path):
    config = json.loads((tokenizer.file.parent / "tokenizer_config.json").read_text())
    (folder / "tokenizer.json").write_bytes(tokenizer.file.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_tokenizer(str(folder))


def test_the_chat_tokenizer_stops_at_the_end_of_a_document_and_of_a_turn(tokenizer, tmp_path):
    eos, end = (tokenizer.tokenizer.token_to_id(t) for t in (EOS, CHAT_TOKENS[1]))
    assert tokenizer.eos_id == eos and chat.end_of_turn(tokenizer) == end
    assert chat.stop_ids(tokenizer) == [eos, end]
    read = transformers.GenerationConfig.from_pretrained(tokenizer.file.parent)  # as transformers reads it
    assert read.eos_token_id == [eos, end] and read.bos_token_id == eos
    # without a generation_config.json: the EOS, and the template's end of turn where it has one
    closed = _with_template(
        tokenizer, "{% for m in messages %}{{ m.role + ': ' + m.content + '<|im_end|>' }}{% endfor %}", tmp_path
    )
    assert chat.stop_ids(closed) == [eos, end]
    (tmp_path / "plain").mkdir()
    plain = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n\\n' }}{% endfor %}"
    assert chat.stop_ids(_with_template(tokenizer, plain, tmp_path / "plain")) == [eos]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """n tokens after `prompt`, each the most likely, stopping at nothing."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def source(tokenizer, tmp_path_factory):
    """A random Llama with the chat tokenizer and SOURCE_IDS, its head made to say <|im_end|> a few
    tokens into its reply to MESSAGE (its row for token 2 twice the row of the token said there), after
    which it would go on. Returns the folder and its greedy reply, stopping at nothing."""
    folder = tmp_path_factory.mktemp("source")
    model = hf_llama(folder, tie_word_embeddings=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer.file.parent / name, folder / name)
    prompt = tokenizer.encode(chat.Renderer.of(tokenizer)([{"role": "user", "content": MESSAGE}], True))
    with torch.no_grad():
        model.lm_head.weight[2] = 2 * model.lm_head.weight[_greedy(model, prompt, 4)[3]]
    model.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    (folder / "generation_config.json").write_text(json.dumps({**SOURCE_IDS, "max_new_tokens": 30}))
    said = _greedy(model, prompt, 16)
    assert 2 in said[:-1]
    return folder, said


def test_an_import_is_set_up_for_chat_fine_tuning_and_gives_back_the_sources_ids(source, tmp_path, monkeypatch, capsys):
    """import -> fine-tune a step on conversations -> export: the exported generation_config has the
    source's eos list, bos and pad (and its sampling defaults)."""
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "--from-hf", str(source[0]), "imported"]) == 0
    assert (
        "podtrain train imported/config.yaml data.path=CHATS.jsonl run_dir=imported-chat train.init_from=imported"
        in capsys.readouterr().out
    )
    saved = yaml.safe_load(Path("imported/config.yaml").read_text())
    assert (saved["train"]["lr"], saved["train"]["weight_decay"], saved["train"]["sample_tokens"]) == (1e-5, 0.0, 64)
    assert {k: saved["data"][k] for k in ("source", "format", "path", "tokenizer")} == {
        "source": "text",
        "format": "chat",
        "path": None,
        "tokenizer": "imported/tokenizer",
    }
    assert main(["train", "imported/config.yaml", "run_dir=chat"]) == 2  # the conversations are asked for
    assert "data.path is not set" in capsys.readouterr().err and not Path("chat").exists()
    job = [f"data.path={CHAT_FILE}", "run_dir=chat", "train.init_from=imported", "train.steps=1"]
    job += [
        "train.batch_size=8",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=4",
        "log.to=[jsonl]",
    ]
    assert main(["train", "imported/config.yaml", *job]) == 0
    assert main(["convert", "--to-hf", "chat", "exported"]) == 0
    generation = json.loads(Path("exported/generation_config.json").read_text())
    assert {k: generation[k] for k in SOURCE_IDS} == SOURCE_IDS and generation["max_new_tokens"] == 30
    read = transformers.GenerationConfig.from_pretrained("exported")
    assert (read.eos_token_id, read.bos_token_id, read.pad_token_id) == ([2, 0], 1, 0)


def test_without_a_generation_config_the_ids_of_config_json_come_back_with_the_end_of_turn(source, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(source[0], folder)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    assert main(["convert", "--from-hf", str(folder), str(tmp_path / "run")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert {k: generation[k] for k in SOURCE_IDS} == {"bos_token_id": 1, "eos_token_id": [0, 2], "pad_token_id": 0}


def test_generate_stops_at_the_end_of_turn_and_replies_as_transformers_on_the_export(
    tokenizer, source, tmp_path, capsys
):
    folder, said = source
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    assert main(["convert", "--from-hf", str(folder), run]) == 0
    assert main(["convert", "--to-hf", run, out, "--dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(["generate", run, "--chat", MESSAGE, "--greedy", "--max-new-tokens", "16"]) == 0
    reply = capsys.readouterr().out
    stop = next(i for i, t in enumerate(said) if t in SOURCE_IDS["eos_token_id"])
    assert stop < len(said) - 1 and reply == tokenizer.decode(said[:stop]) + "\n"  # not a token past the stop

    theirs = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = theirs.apply_chat_template(
        [{"role": "user", "content": MESSAGE}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        new = model.generate(**ids, max_new_tokens=16, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
    assert new == said[: stop + 1] and theirs.decode(new[:-1]) + "\n" == reply

    prompt = chat.Renderer.of(tokenizer)([{"role": "user", "content": MESSAGE}], True)  # the same, as text
    assert main(["generate", run, "--prompt", prompt, "--greedy", "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == prompt + reply
    assert main(["generate", run, "--prompt", "Hi", "--chat", MESSAGE]) == 2
    assert main(["generate", run, "--system", "Be brief."]) == 2
    assert "not both" in capsys.readouterr().err
