"""Tokenizers (Hugging Face `tokenizers` files, the demo byte tokenizer) and incremental detokenisation.

The HF tokenizers here are real ones trained in the test: a byte-level BPE with DeepSeek's special
tokens, and a SentencePiece-style BPE (Metaspace, byte fallback) whose decoding depends on the
neighbouring token. Chat templates are checked by hand and against transformers' rendering.
"""

import json
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from serving.demo_model import DEMO_MARKER
from serving.tokenizer import (BYTE_OFFSET, ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer,
                               load_tokenizer)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "serving", "tokens", "model", "café",
         "naïve", "façade", "Zürich", "señor", "crème", "brûlée", "Ærø", "你好", "世界", "模型", "推理", "日本語",
         "テキスト", "한국어", "Привет", "мир", "😀", "🎉", "👍🏽", "👩‍💻", "🇯🇵", "∑", "→", "½", "12", "345", ",", "."]
TEXTS = ["Hello, world!", "héllo wörld", "你好，世界。", "模型推理很快", "emoji: 😀🎉👍🏽 and 👩‍💻 🇯🇵",
         "mixed 日本語テキスト with ASCII and ½ → ∑", "Ωμέγα עברית العربية", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
         "tabs\tand\nnewlines\n\n  and  spaces", "combining a\u0301 e\u0308", "", " leading space", "x"]
# A DeepSeek-style template with block tags on their own lines: the output is clean only when
# trim_blocks and lstrip_blocks are on.
TEMPLATE = """{% set ns = namespace(system='') %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% set ns.system = ns.system + m['content'] %}
    {% endif %}
{% endfor %}
{{ bos_token }}{{ ns.system }}
{% for m in messages %}
    {% if m['role'] == 'user' %}
<｜User｜>{{ m['content'] }}
    {% elif m['role'] == 'assistant' %}
<｜Assistant｜>{{ m['content'] }}{{ eos_token }}
    {% elif m['role'] == 'tool' %}
<tool>{{ m['content'] | tojson }}</tool>
    {% elif m['role'] != 'system' %}
        {{ raise_exception('unsupported role: ' + m['role']) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2? 你好 😀"}],
    [{"role": "user", "content": "run it"}, {"role": "tool", "content": "<ok> & \"naïve\" 模型"}],
]


def _corpus(n_lines=400, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n_lines)]


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE like DeepSeek's: any text encodes, characters can split across tokens."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=[BOS, EOS, USER, ASSISTANT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def sentencepiece_bpe():
    """A Llama-style BPE: Metaspace word marks, byte fallback for characters it never saw."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    latin = [w for w in WORDS if all(ord(c) < 0x250 for c in w)]
    rng = random.Random(1)
    tok.train_from_iterator([" ".join(rng.choice(latin) for _ in range(8)) for _ in range(300)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS], show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab) + 2)  # +2: ids of the two added special tokens
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return RawTokenizer.from_str(json.dumps(spec))


def _write_dir(path, raw, config=None, post_processor_bos=False):
    os.makedirs(path, exist_ok=True)
    raw = RawTokenizer.from_str(raw.to_str())
    if post_processor_bos:
        raw.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    raw.save(os.path.join(path, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False)
    return str(path)


def _config(**overrides):
    config = {"bos_token": {"__type": "AddedToken", "content": BOS, "special": True}, "eos_token": EOS,
              "add_bos_token": True, "add_eos_token": False, "chat_template": TEMPLATE}
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not None}


@pytest.fixture(scope="module")
def hf_dir(byte_bpe, tmp_path_factory):
    return _write_dir(tmp_path_factory.mktemp("hf"), byte_bpe, _config())


@pytest.fixture(scope="module")
def hf(hf_dir):
    return HFTokenizer.from_directory(hf_dir)


@pytest.fixture(scope="module")
def sp(sentencepiece_bpe, tmp_path_factory):
    return HFTokenizer.from_directory(_write_dir(tmp_path_factory.mktemp("sp"), sentencepiece_bpe,
                                                 {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}))


def _stream(tok, ids, chunks, prompt_ids=(), skip_special_tokens=True):
    """Push `ids` in chunks of the given sizes (cycled); check each piece is final; return the pieces."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    full = tok.decode(list(prompt_ids) + list(ids), skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt_text)
    final = full[len(prompt_text):]
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        pieces.append(detok.push(ids[i:i + n]))
        i, k = i + n, k + 1
        # Never text that a later token changes (a broken character, a U+FFFD later completed).
        assert final.startswith("".join(pieces)), (pieces, final)
    pieces.append(detok.finish())
    assert "".join(pieces) == final
    return pieces


# --- HFTokenizer ---------------------------------------------------------------------------------


def test_hf_round_trips_text_with_accents_cjk_and_emoji(hf):
    assert isinstance(hf, Tokenizer)
    split_characters = 0
    for text in TEXTS + _corpus(50, seed=7):
        ids = hf.encode(text)
        assert ids[0] == hf.bos_token_id == 0
        assert hf.encode(text, add_special_tokens=False) == ids[1:]
        assert hf.decode(ids) == text
        assert hf.decode(ids, skip_special_tokens=False) == BOS + text
        split_characters += sum("\ufffd" in hf.decode([i]) for i in ids[1:])
    assert split_characters > 10  # the incremental tests below need characters split across tokens


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_hf_round_trips_random_unicode(hf, text):
    assert hf.decode(hf.encode(text)) == text


@pytest.mark.parametrize("post_processor_bos, add_bos_token, leading_bos", [
    (False, True, 1), (True, True, 1), (True, False, 1), (False, False, 0), (False, None, 0)])
def test_hf_adds_bos_once(byte_bpe, tmp_path, post_processor_bos, add_bos_token, leading_bos):
    tok = HFTokenizer.from_directory(_write_dir(tmp_path, byte_bpe, _config(add_bos_token=add_bos_token),
                                                post_processor_bos=post_processor_bos))
    body = tok.encode("café 你好", add_special_tokens=False)
    assert tok.encode("café 你好") == [0] * leading_bos + body
    assert body[0] != 0
    # A rendered chat template starts with the BOS text; encoding it must not double the BOS.
    assert tok.encode(BOS + "café 你好", add_special_tokens=False) == [0] + body
    if not post_processor_bos:
        assert tok.encode(BOS + "café 你好") == [0] + body


def test_hf_special_token_ids(byte_bpe, tmp_path):
    tok = HFTokenizer.from_directory(_write_dir(tmp_path / "a", byte_bpe, _config()), extra_eos_token_ids=(3,))
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, (1, 3))
    assert tok.vocab_size == byte_bpe.get_vocab_size() > 400
    bare = HFTokenizer.from_directory(_write_dir(tmp_path / "b", byte_bpe), fallback_bos_token_id=2,
                                      extra_eos_token_ids=(1,))
    assert (bare.bos_token_id, bare.eos_token_ids, bare.has_chat_template) == (2, (1,), False)
    assert bare.encode("x") == bare.encode("x", add_special_tokens=False)  # no add_bos_token: none added
    with pytest.raises(ValueError, match="not in tokenizer.json's vocabulary"):
        HFTokenizer.from_directory(_write_dir(tmp_path / "c", byte_bpe, _config(bos_token="<s>")))
    with pytest.raises(ValueError, match="add_bos_token"):
        HFTokenizer.from_directory(_write_dir(tmp_path / "d", byte_bpe, _config(add_bos_token="yes")))


def test_hf_decode_skips_ids_outside_the_tokenizer_vocabulary(hf):
    ids = hf.encode("naïve", add_special_tokens=False)
    assert hf.decode([*ids[:1], hf.vocab_size, 5000, *ids[1:]]) == "naïve"


# --- chat templates ------------------------------------------------------------------------------


def test_chat_template_renders_by_hand(hf):
    conversation = CONVERSATIONS[1]
    assert hf.has_chat_template
    body = f"{BOS}Be brief.\n{USER}Hi\n{ASSISTANT}Hello!{EOS}\n{USER}2+2? 你好 😀\n"
    assert hf.apply_chat_template(conversation, add_generation_prompt=False) == body
    assert hf.apply_chat_template(conversation) == body + ASSISTANT
    tool = hf.apply_chat_template(CONVERSATIONS[2], add_generation_prompt=False)
    assert tool.endswith('<tool>"<ok> & \\"naïve\\" 模型"</tool>\n')  # JSON, not HTML-escaped


@pytest.mark.parametrize("form", ["string", "named_list"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(byte_bpe, tmp_path, monkeypatch, form, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    template = TEMPLATE if form == "string" else [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                                                  {"name": "default", "template": TEMPLATE}]
    path = _write_dir(tmp_path, byte_bpe, _config(chat_template=template))
    ours, theirs = HFTokenizer.from_directory(path), transformers.AutoTokenizer.from_pretrained(path)
    for conversation in CONVERSATIONS:
        expected = theirs.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_from_chat_template_jinja_file(byte_bpe, tmp_path):
    path = _write_dir(tmp_path, byte_bpe, _config(chat_template=None))
    assert not HFTokenizer.from_directory(path).has_chat_template
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    tok = HFTokenizer.from_directory(path)
    assert tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False) == "[user] Hi\n"


def test_chat_template_errors_reach_the_caller_as_value_errors(hf, byte_bpe, tmp_path):
    with pytest.raises(ValueError, match="unsupported role: robot"):
        hf.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError):  # the sandbox is immutable: templates cannot mutate the messages
        HFTokenizer(byte_bpe, chat_template="{{ messages.append(1) }}").apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError):  # nor reach Python internals
        HFTokenizer(byte_bpe, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}"
                    ).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="does not compile"):
        HFTokenizer(byte_bpe, chat_template="{% for m in messages %}")
    no_default = [{"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}]
    tok = HFTokenizer.from_directory(_write_dir(tmp_path / "nd", byte_bpe, _config(chat_template=no_default)))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match=r"\['rag', 'tool_use'\] but none named 'default'"):
        tok.apply_chat_template(CONVERSATIONS[0])
    bare = HFTokenizer.from_directory(_write_dir(tmp_path / "bare", byte_bpe))
    with pytest.raises(ValueError, match="no chat_template"):
        bare.apply_chat_template(CONVERSATIONS[0])


MALFORMED = [[{"role": "user"}], [{"content": "hi"}], [{"role": "user", "content": 3}],
             [{"role": None, "content": "hi"}], ["user: hi"], "user: hi", {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages", MALFORMED)
def test_malformed_messages_are_value_errors(hf, messages):
    for tok in (hf, ByteTokenizer(512)):
        with pytest.raises(ValueError):
            tok.apply_chat_template(messages)


# --- load_tokenizer ------------------------------------------------------------------------------


def test_load_tokenizer_picks_by_directory_contents(hf_dir, tmp_path):
    v = HFTokenizer.from_directory(hf_dir).vocab_size
    tok = load_tokenizer(hf_dir, vocab_size=v, bos_token_id=0, eos_token_id=3)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (1, 3)
    with pytest.raises(ValueError, match=f"{v} token ids but the model's vocabulary has {v - 1}"):
        load_tokenizer(hf_dir, vocab_size=v - 1, bos_token_id=0, eos_token_id=1)
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / DEMO_MARKER).write_text("{}")
    tok = load_tokenizer(str(demo), vocab_size=512, bos_token_id=0, eos_token_id=1)
    assert isinstance(tok, ByteTokenizer) and (tok.bos_token_id, tok.eos_token_ids) == (0, (1,))
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(str(tmp_path), vocab_size=512, bos_token_id=0, eos_token_id=1)
    assert str(tmp_path / "tokenizer.json") in str(e.value) and DEMO_MARKER in str(e.value)


# --- ByteTokenizer -------------------------------------------------------------------------------


def test_byte_tokenizer_layout_and_template():
    tok = ByteTokenizer(512)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("aé") == [0, ord("a") + 2, 0xC3 + 2, 0xA9 + 2] and BYTE_OFFSET == 2
    assert tok.encode("aé", add_special_tokens=False) == tok.encode("aé")[1:]
    assert tok.decode([0, 1, 300, *tok.encode("😀", add_special_tokens=False), 258]) == "😀"
    assert ByteTokenizer(512, None, None).encode("a") == [ord("a") + 2]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "你好"}]
    assert tok.apply_chat_template(messages) == "<|system|>s\n<|user|>你好\n<|assistant|>"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<|system|>s\n<|user|>你好\n"
    with pytest.raises(ValueError, match="vocab_size >= 258"):
        ByteTokenizer(257)
    with pytest.raises(ValueError, match="not a byte id"):
        ByteTokenizer(512, bos_token_id=5)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80), chunks=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(any))
def test_byte_tokenizer_round_trip_and_streaming_random_unicode(text, chunks):
    tok = ByteTokenizer(512)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text
    pieces = _stream(tok, ids, chunks)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=60), chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_byte_tokenizer_streaming_random_bytes(data, chunks):
    _stream(ByteTokenizer(512), [b + BYTE_OFFSET for b in data], chunks)


# --- IncrementalDetokenizer ----------------------------------------------------------------------


def _byte_ids(data: bytes):
    return [b + BYTE_OFFSET for b in data]


def test_incomplete_and_invalid_bytes_show_only_when_final():
    tok = ByteTokenizer(512)
    detok = IncrementalDetokenizer(tok)
    # 中 is E4 B8 AD: held back until complete.
    assert [detok.push(_byte_ids(b)) for b in (b"a", b"\xe4", b"\xb8", b"\xad")] == ["a", "", "", "中"]
    # A lone invalid byte is final once text follows it.
    assert [detok.push(_byte_ids(b)) for b in (b"\xff", b"b")] == ["", "\ufffdb"]
    # A truncated character shows as U+FFFD at finish.
    assert detok.push(_byte_ids(b"\xf0\x9f\x98")) == ""
    assert detok.finish() == "\ufffd"
    with pytest.raises(RuntimeError):
        detok.push([5])
    # A long run of invalid bytes is released as it becomes final, not only at finish.
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(_byte_ids(b"\xff")) for _ in range(100))
    assert pushed == "\ufffd" * len(pushed) and len(pushed) >= 100 - IncrementalDetokenizer.MAX_PENDING
    assert pushed + detok.finish() == "\ufffd" * 100
    # ... and a character that starts at the end of such a run still completes.
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(_byte_ids(b"\xff")) for _ in range(IncrementalDetokenizer.MAX_PENDING)]
    pieces += [detok.push(_byte_ids(b)) for b in (b"\xe4", b"\xb8", b"\xad")]
    assert "".join(pieces) + detok.finish() == "\ufffd" * IncrementalDetokenizer.MAX_PENDING + "中"
    assert pieces[-1].endswith("中")


@pytest.mark.parametrize("chunks", [[1], [2], [1, 3, 2], [7]])
def test_streaming_text_matches_full_decode(hf, sp, chunks):
    for tok in (hf, sp, ByteTokenizer(512)):
        for text in TEXTS + _corpus(20, seed=3):
            pieces = _stream(tok, tok.encode(text, add_special_tokens=False), chunks)
            assert not any("\ufffd" in p for p in pieces)


def test_streaming_random_token_streams(hf):
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.randrange(hf.vocab_size + 3) for _ in range(rng.randint(1, 40))]  # + ids beyond the vocab
        chunks = [rng.randint(1, 4) for _ in range(3)]
        _stream(hf, ids, chunks, skip_special_tokens=trial % 2 == 0)


def test_streaming_keeps_left_context_after_the_prompt(sp, hf):
    text = "the quick brown fox jumps over the lazy dog"
    ids = sp.encode(text, add_special_tokens=False)
    cut = next(i for i in range(2, len(ids)) if sp.decode(ids[:i]) == "the quick")
    pieces = _stream(sp, ids[cut:], [1], prompt_ids=ids[:cut])
    # SentencePiece drops the first token's leading space when decoding alone; after the prompt it stays.
    assert "".join(pieces) == " brown fox jumps over the lazy dog" != sp.decode(ids[cut:])
    # A prompt that ends inside a run of byte-fallback tokens (你好 is 6 of them; the generated
    # 世界 continues the run): the context must not start mid-character.
    ids = sp.encode("the dog 你好世界 fox", add_special_tokens=False)
    cut = next(i for i in range(len(ids)) if sp.decode(ids[:i]) == "the dog 你好")
    assert "\ufffd" in sp.decode(ids[cut - IncrementalDetokenizer.CONTEXT:cut])
    assert "".join(_stream(sp, ids[cut:], [1], prompt_ids=ids[:cut])) == "世界 fox"
    prompt = hf.encode("模型 ")
    _stream(hf, hf.encode("推理 😀 done", add_special_tokens=False), [1], prompt_ids=prompt)


def test_streaming_skips_special_tokens_without_losing_context(sp):
    ids = sp.encode("the lazy dog", add_special_tokens=False)
    eos = sp.eos_token_ids[0]
    noisy = [ids[0], *[eos] * 10, *ids[1:]]
    assert "".join(_stream(sp, noisy, [1])) == "the lazy dog"


class _CountingDecoder:
    """Records the longest id list decoded: the detokeniser must decode a bounded window."""

    def __init__(self, inner):
        self.inner, self.longest = inner, 0

    def decode(self, ids, *, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_streaming_work_per_push_is_bounded(hf):
    long_text = " ".join(_corpus(200, seed=11))
    streams = {
        "text": (hf, hf.encode(long_text, add_special_tokens=False)),
        "special tokens": (hf, [0, 1, 2, 3] * 500),
        "invalid bytes": (ByteTokenizer(512), _byte_ids(b"\xff\xe4\xb8" * 700)),
    }
    for name, (tok, ids) in streams.items():
        assert len(ids) > 1000, name
        counting = _CountingDecoder(tok)
        detok = IncrementalDetokenizer(counting)
        out = "".join(detok.push(ids[i:i + 2]) for i in range(0, len(ids), 2)) + detok.finish()
        assert out == tok.decode(ids), name
        # Context (the last emission) plus held tokens, each at most MAX_PENDING + one push.
        assert counting.longest <= 2 * (IncrementalDetokenizer.MAX_PENDING + 2), name
