"""Chat fine-tuning data: conversations rendered with the tokenizer's own template (as transformers
renders them), the loss on the assistant's tokens only, conversations packed apart."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from podtrain.data import chat
from podtrain.data.tokenizer import fit_bpe, load_tokenizer
from podtrain.errors import DataError
from podtrain.models import build_model
from podtrain.program.load import load_config
from podtrain.program.tasks.language import chat_loss, token_losses

CHAT_FILE = Path(__file__).parent.parent / "configs" / "data" / "chat_tiny.jsonl"
CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "4 + 4 = 8."},
    ],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}],
    [{"role": "user", "content": "Reverse abc."}, {"role": "assistant", "content": "cba"}],
]
# A template in the style of Llama 3's: a BOS, a system turn checked with raise_exception, loop controls.
HEADERS = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ raise_exception('no tools here') }}{% endif %}{% if message['content'] == '' %}{% continue %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n\\n' + message['content'] | trim + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    text = " ".join(m["content"] for c in CONVERSATIONS for m in c) + " user assistant system " * 20
    return fit_bpe([text] * 5, 300, folder, chat=True)


def with_template(tokenizer, template, tmp_path):
    """The tokenizer's files in tmp_path with another chat template."""
    config = json.loads((tokenizer.file.parent / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer.json").write_bytes(tokenizer.file.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("template", ["chatml", "headers"])
def test_conversations_render_as_transformers_renders_them(tokenizer, tmp_path, template):
    transformers = pytest.importorskip("transformers")
    ours = tokenizer if template == "chatml" else with_template(tokenizer, HEADERS, tmp_path)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(ours.file.parent))
    renderer = chat.Renderer.of(ours)
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            assert renderer(messages, prompt) == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt
            )
    if template == "headers":
        with pytest.raises(DataError, match="no tools here"):
            renderer([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("template", ["chatml", "headers"])
def test_the_loss_mask_covers_exactly_the_assistants_tokens(tokenizer, tmp_path, template):
    ours = tokenizer if template == "chatml" else with_template(tokenizer, HEADERS, tmp_path)
    renderer = chat.Renderer.of(ours)
    tokens, trained = chat.encode(ours, renderer, CONVERSATIONS[0])
    closing = "<|im_end|>\n" if template == "chatml" else "<|im_end|>"
    assert ours.decode(tokens[trained]) == f"2 + 3 = 5.{closing}4 + 4 = 8.{closing}"
    assert ours.decode(tokens) == renderer(CONVERSATIONS[0])  # the whole conversation, nothing dropped


# Qwen3's way with reasoning, in a few lines: a reply's "<think>...</think>" is kept after the last
# user question and dropped before it, so a whole conversation renders its earlier turns otherwise.
DROPS_REASONING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'assistant' %}{% set content = m.content %}"
    "{% if loop.index0 < ns.last %}{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{% else %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _trained(tokenizer, messages):
    tokens, trained = chat.encode(tokenizer, chat.Renderer.of(tokenizer), messages)
    return chat.trained_pieces(tokenizer, tokens, trained), tokenizer.decode(tokens[: np.argmax(trained)])


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello"}],
        [
            {"role": "system", "content": "Always answer: I don't know."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "I don't know."},
        ],
    ],
)
def test_a_reply_that_repeats_earlier_text_is_trained_where_it_is_said(tokenizer, messages):
    pieces, untrained = _trained(tokenizer, messages)
    assert pieces == [messages[-1]["content"] + "<|im_end|>\n"]
    assert untrained.endswith("<|im_start|>assistant\n")  # nothing of the prompt turns is trained


def test_every_kind_of_conversation_trains_exactly_its_assistant_turns(tokenizer, tmp_path):
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": ""},  # a reply that is only a tool call, say
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "5"},
    ]
    assert _trained(tokenizer, turns)[0] == ["<|im_end|>\n", "5<|im_end|>\n", "5<|im_end|>\n"]
    reasoning = with_template(tokenizer, DROPS_REASONING, tmp_path)
    thought = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "<think>greet</think> hello"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "<think>repeat</think> hello"},
    ]
    text, spans = chat.Renderer.of(reasoning).assistant_spans(thought)
    assert "greet" not in text and [text[a:b] for a, b in spans] == [
        "hello<|im_end|>\n",
        "<think>repeat</think> hello<|im_end|>\n",
    ]


def test_data_chat_shows_the_trained_text_of_each_conversation(tokenizer, tmp_path, capsys):
    from podtrain.cli import main

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS[1:]))
    folder = str(tokenizer.file.parent)
    assert main(["data", "chat", str(path), "--tokenizer", folder, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["trained"] for r in rows] == [["Hello there!<|im_end|>\n"], ["cba<|im_end|>\n"]]
    assert main(["data", "chat", str(path), "--tokenizer", folder, "--show"]) == 0
    assert "<|im_start|>assistant\n«Hello there!<|im_end|>\n»" in capsys.readouterr().out


def test_packed_conversations_score_as_each_alone(tokenizer, small_overrides):
    """Two conversations packed in one row: each token's loss is the one it has alone (segment
    ids keep them apart), and the row's loss is the mean over both conversations' assistant tokens."""
    renderer = chat.Renderer.of(tokenizer)
    examples = [chat.encode(tokenizer, renderer, c) for c in CONVERSATIONS[:2]]
    length = sum(len(t) for t, _ in examples) + 5  # both fit one row, with padding after them
    packed, cut = chat.pack(examples, length, pad_id=0)
    assert packed.shape == (1, 3, length) and cut == 0
    assert list(np.unique(packed[0, chat.SEGMENTS])) == [0, 1, 2]
    model = build_model(
        load_config(None, [*small_overrides, f"model.max_seq_len={length}", "model.vocab_size=300"]).model, nnx.Rngs(0)
    )
    alone = [chat.pack([e], len(e[0]), pad_id=0)[0] for e in examples]

    def losses(rows):
        table, x, _ = model.features(rows[:, chat.TOKENS, :-1], rows[:, chat.SEGMENTS, :-1])
        return token_losses(model.logits(table, x), rows[:, chat.TOKENS, 1:])[0]

    together, first = losses(jnp.asarray(packed)), len(examples[0][0])
    np.testing.assert_allclose(together[: first - 1], losses(jnp.asarray(alone[0])), atol=2e-5)
    np.testing.assert_allclose(
        together[first : first + len(examples[1][0]) - 1], losses(jnp.asarray(alone[1])), atol=2e-5
    )
    counts = [int(e[1][1:].sum()) for e in examples]
    means = [float(chat_loss(model, None, jnp.asarray(a), None)[0]) for a in alone]
    expected = (means[0] * counts[0] + means[1] * counts[1]) / sum(counts)
    np.testing.assert_allclose(float(chat_loss(model, None, jnp.asarray(packed), None)[0]), expected, rtol=1e-5)


def test_bad_chat_files_and_tokenizers_are_clear_errors(tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "not a conversation"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2 is not a conversation"):
        chat.read_conversations(str(bad))
    (tmp_path / "plain").mkdir()
    plain = fit_bpe(["some text"] * 3, 280, tmp_path / "plain")
    with pytest.raises(DataError, match="has none"):
        chat.chat_template(plain)
    renderer = chat.Renderer("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}", {})
    with pytest.raises(DataError, match="does not write assistant turn 1"):  # a count after the turns: no prefix
        renderer.assistant_spans(CONVERSATIONS[1])
    assert jax.devices()  # the errors came before any device was needed


def test_chat_fine_tuning_an_imported_model_lowers_the_held_out_assistant_loss(tokenizer, tmp_path):
    """sft_tiny's path at test size: a Qwen3 from transformers imported with the chat tokenizer,
    then `train` with data.format=chat on the repo's chat file from those weights."""
    pytest.importorskip("transformers")
    from podtrain.cli import main

    from test_hf_families import hf_model

    base = tmp_path / "base"
    hf_model(base, "qwen3", {"max_position_embeddings": 128, "head_dim": 16})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((tokenizer.file.parent / name).read_bytes())
    assert main(["convert", "--from-hf", str(base), str(tmp_path / "imported")]) == 0
    overrides = [
        "data.source=text",
        "data.format=chat",
        f"data.path={CHAT_FILE}",
        f"train.init_from={tmp_path / 'imported'}",
        f"run_dir={tmp_path / 'sft'}",
        "train.seq_len=96",
        "train.batch_size=8",
        "train.steps=24",
        "train.lr=3e-3",
        "train.warmup_steps=5",
        "train.eval_every=8",
        "train.eval_batches=2",
        "train.sample_tokens=8",
        "log.to=[jsonl]",
    ]
    assert main(["train", str(tmp_path / "imported" / "config.yaml"), *overrides]) == 0
    evals = [
        m["val_loss"]
        for m in map(json.loads, (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in m
    ]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0, evals


def test_chat_format_needs_a_file_of_conversations_and_the_xla_attention(small_overrides):
    from podtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="set data.source=text and data.path=FILE_OR_DIR"):
        load_config(None, [*small_overrides, "data.format=chat"])
    with pytest.raises(ConfigError, match="data.format=chat keeps attention inside documents"):
        load_config(
            None, [*small_overrides, "data.format=chat", "data.source=text", "data.path=x", "model.attention=cudnn"]
        )
