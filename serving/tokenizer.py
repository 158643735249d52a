"""Tokenizers for serving, and incremental detokenisation for streaming.

Lifecycle: `load_tokenizer(model_dir, ...)` runs once at start-up and picks the tokenizer from
what the checkpoint directory holds:

- `tokenizer.json` -> `HFTokenizer` (Hugging Face `tokenizers`), with `tokenizer_config.json`
  supplying the BOS / EOS tokens, `add_bos_token` and the Jinja chat template when present;
- the embedded demo model's marker file -> `ByteTokenizer` (UTF-8 bytes as ids);
- anything else is a `FileNotFoundError` naming the file that is missing.

Both satisfy the `Tokenizer` protocol, which is all the engine and the server see. Tokenizer
objects are not mutated after construction, so one instance serves every request.

Streaming: each running request owns one `IncrementalDetokenizer` (not thread-safe; one
thread pushes to it). `push(new_ids)` returns only text that no later token can change: a
character whose UTF-8 bytes are split across tokens is held back until it is complete, and the
work per push is bounded by the new tokens plus a few tokens of left context, never the whole
output so far. Stop strings are the engine's business; a caller that streams with stop strings
holds back the longest suffix of the text so far that is a prefix of some stop string, and
releases it once the next text rules the stop string out.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Newer transformers releases save the chat template beside tokenizer_config.json rather than in it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

BYTE_OFFSET = 2  # ByteTokenizer: ids 0 and 1 are BOS / EOS; byte b is id b + 2
_REPLACEMENT = "\ufffd"


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer.

    vocab_size: ids the tokenizer can produce are in [0, vocab_size).
    bos_token_id: prepended by `encode(..., add_special_tokens=True)`; None when the model has none.
    eos_token_ids: generation stops at any of these.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; ValueError when there is no template or a message is malformed."""
        ...


def _checked_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """Copies of the messages as plain dicts; ValueError unless each has string `role` and `content`."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError("messages must be a sequence of {'role': ..., 'content': ...} mappings")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} is a {type(m).__name__}, not a mapping")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"message {i} needs a string {key!r}, got {m.get(key)!r}")
        out.append(dict(m))
    return out


class ByteTokenizer:
    """UTF-8 bytes as tokens, for the embedded demo model: byte b is id b + 2, ids 0 and 1 are BOS / EOS.

    Ids that are not bytes (BOS, EOS, the rest of the model's vocabulary) decode to nothing,
    whatever `skip_special_tokens` says: they have no text.

    Built-in chat template, since there is no tokenizer_config.json to carry one: each message
    becomes "<|role|>content\\n", and add_generation_prompt appends "<|assistant|>". The
    markers are ordinary bytes, not special ids.
    """

    has_chat_template = True

    def __init__(self, vocab_size: int, bos_token_id: int | None = 0, eos_token_id: int | None = 1):
        if vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {256 + BYTE_OFFSET}, got {vocab_size}")
        for name, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tid is not None and (not 0 <= tid < vocab_size or BYTE_OFFSET <= tid < 256 + BYTE_OFFSET):
                raise ValueError(f"{name}={tid} must be in [0, {vocab_size}) and not a byte id "
                                 f"[{BYTE_OFFSET}, {256 + BYTE_OFFSET})")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in _checked_messages(messages))
        return text + "<|assistant|>" if add_generation_prompt else text


def _token_content(value: object, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{TOKENIZER_CONFIG_FILE}: {key} must be a string or {{'content': ...}}, got {value!r}")


def _chat_template_source(config: Mapping[str, object]) -> tuple[str | None, str]:
    """(template, why there is none): `chat_template` as a string, or the entry named "default" of the list form."""
    value = config.get("chat_template")
    if value is None:
        return None, f"no chat_template in {TOKENIZER_CONFIG_FILE}"
    if isinstance(value, str):
        return value, ""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"], ""
        return None, f"{TOKENIZER_CONFIG_FILE} has chat templates {sorted(map(str, named))} but none named 'default'"
    raise ValueError(f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string or a list of "
                     f"{{'name', 'template'}}, got {type(value).__name__}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON text itself.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile with the environment Hugging Face templates are written for: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, `raise_exception`, a JSON `tojson` and `strftime_now`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from e


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` behind the `Tokenizer` protocol.

    BOS: `encode(..., add_special_tokens=True)` lets the tokenizer's post-processor add its special
    tokens, then, when `add_bos_token` is set, prepends the BOS unless the ids already start with
    it (the post-processor added it, or the text begins with the BOS token, as a rendered chat
    template usually does). Encode a rendered chat template with add_special_tokens=False.
    The BOS and EOS named by tokenizer_config.json win over the model config's; generation stops
    at either EOS.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None, no_template_reason: str = "",
                 fallback_bos_token_id: int | None = None, extra_eos_token_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._bos_token, self._eos_token = bos_token, eos_token
        bos_id, eos_id = self._token_id(bos_token, "bos_token"), self._token_id(eos_token, "eos_token")
        self.bos_token_id = bos_id if bos_id is not None else fallback_bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(i for i in (eos_id, *extra_eos_token_ids) if i is not None))
        self._add_bos = add_bos_token and self.bos_token_id is not None
        self._template = None if chat_template is None else _compile_chat_template(chat_template)
        self.has_chat_template = self._template is not None
        self._no_template_reason = no_template_reason or "the tokenizer has no chat template"

    @classmethod
    def from_directory(cls, directory: str, *, fallback_bos_token_id: int | None = None,
                       extra_eos_token_ids: Sequence[int] = ()) -> HFTokenizer:
        """Read tokenizer.json, and tokenizer_config.json / chat_template.jinja when present."""
        tok = tokenizers.Tokenizer.from_file(os.path.join(directory, TOKENIZER_FILE))
        config: dict = {}
        config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} must hold a JSON object")
        template, reason = _chat_template_source(config)
        template_path = os.path.join(directory, CHAT_TEMPLATE_FILE)
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        add_bos = config.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise ValueError(f"{config_path}: add_bos_token must be true or false, got {add_bos!r}")
        return cls(tok, bos_token=_token_content(config.get("bos_token"), "bos_token"),
                   eos_token=_token_content(config.get("eos_token"), "eos_token"), add_bos_token=add_bos,
                   chat_template=template, no_template_reason=reason, fallback_bos_token_id=fallback_bos_token_id,
                   extra_eos_token_ids=extra_eos_token_ids)

    def _token_id(self, token: str | None, key: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{TOKENIZER_CONFIG_FILE}: {key} {token!r} is not in {TOKENIZER_FILE}'s vocabulary")
        return tid

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        # `tokenizers` skips ids outside its vocabulary (the model's may be padded larger).
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError(self._no_template_reason)
        context: dict[str, object] = {"messages": _checked_messages(messages),
                                      "add_generation_prompt": add_generation_prompt}
        # An unset token stays undefined (renders as "", `is defined` is false), as in transformers.
        for name, token in (("bos_token", self._bos_token), ("eos_token", self._eos_token)):
            if token is not None:
                context[name] = token
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e


def load_tokenizer(model_dir: str, *, vocab_size: int, bos_token_id: int | None,
                   eos_token_id: int | None) -> Tokenizer:
    """The tokenizer for the checkpoint in `model_dir`; vocab_size / bos / eos come from the model config."""
    from serving.demo_model import DEMO_MARKER  # demo_model imports this module

    tokenizer_path = os.path.join(model_dir, TOKENIZER_FILE)
    if os.path.isfile(tokenizer_path):
        tok = HFTokenizer.from_directory(model_dir, fallback_bos_token_id=bos_token_id,
                                         extra_eos_token_ids=() if eos_token_id is None else (eos_token_id,))
        if tok.vocab_size > vocab_size:
            raise ValueError(f"{tokenizer_path} has {tok.vocab_size} token ids but the model's vocabulary "
                             f"has {vocab_size}")
        return tok
    if os.path.isfile(os.path.join(model_dir, DEMO_MARKER)):
        return ByteTokenizer(vocab_size, bos_token_id, eos_token_id)
    raise FileNotFoundError(f"no tokenizer: {tokenizer_path} does not exist (and {model_dir} is not the "
                            f"embedded demo model, which has {DEMO_MARKER})")


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text pieces that no later id can change.

    The concatenation of every `push` and the final `finish()` equals
    `tokenizer.decode(prompt_ids + generated)[len(tokenizer.decode(prompt_ids)):]`, the text the
    generated ids add after the prompt. Without a prompt that is `tokenizer.decode(generated)`;
    after one, SentencePiece-style tokenizers keep the leading space of the first generated
    word, which decoding the generated ids alone would strip.

    Technique ("prefix offset / read offset"): the window `_ids` starts at a clean boundary (the
    text up to it is final and no character spans it) with the tokens of the last emission as left
    context, `_ids[:_read]`, followed by the tokens not emitted yet. Each push decodes only the
    window. While its text ends in U+FFFD, which may be a character whose remaining bytes are
    still to come, everything is held; otherwise the text past the context's is emitted and the
    window restarts with the just-emitted tokens as context. Emitting only at token boundaries
    matters for byte-fallback decoders, which show a whole run of byte tokens as U+FFFDs while
    its last character is incomplete.

    A held tail longer than `MAX_PENDING` tokens is cut at its rightmost clean token boundary,
    or, in a run of invalid bytes where there is none, where decoding is additive,
    `decode(a) + decode(b) == decode(a + b)`, which for UTF-8 means no character spans the cut;
    the text left of the cut is final and is emitted. So the window stays bounded, every push
    costs O(new tokens), and a genuinely invalid sequence shows as U+FFFD once later text proves
    it final, once a cut releases it, or at `finish()`.

    Exactness needs decoding to have the prefix property away from an incomplete tail: true for
    byte-level BPE (DeepSeek), Metaspace and WordPiece decoders and the byte tokenizer. The
    `ByteFallback` decoder breaks it only on invalid UTF-8 (one bad byte turns its whole run of byte
    tokens, already emitted characters included, into U+FFFDs); then pieces follow the window.
    """

    CONTEXT = 4  # prompt tokens kept as left context (SentencePiece strips the first token's space)
    MAX_PENDING = 8  # a UTF-8 character is at most 4 bytes; more held tokens means invalid bytes

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._finished = False
        tail = list(prompt_ids[max(0, len(prompt_ids) - self.CONTEXT):])
        # Start the context on a character boundary: one that begins mid-character decodes to U+FFFD
        # (for byte fallback, its whole byte run does, and the generated bytes would join that run).
        start = next((i for i in range(len(tail)) if not self._decode(tail[i:]).startswith(_REPLACEMENT)), len(tail))
        self._restart(tail[start:])

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _restart(self, context: list[int]) -> None:
        self._ids, self._read = context, len(context)
        self._context_text = self._decode(context)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly final text (possibly "")."""
        if self._finished:
            raise RuntimeError("push after finish()")
        if len(new_ids) == 0:
            return ""
        self._ids.extend(new_ids)
        text = self._decode(self._ids)
        if not text.endswith(_REPLACEMENT):
            if text == self._context_text and self._read == len(self._ids) - len(new_ids):
                # Ids without text (skipped special tokens, ids outside the vocabulary) are dropped, so
                # the context keeps tokens that have text.
                del self._ids[self._read:]
                return ""
            return self._emit_through(len(self._ids), text)
        if len(self._ids) - self._read > self.MAX_PENDING:
            return self._release_final(text)
        return ""

    def _release_final(self, text: str) -> str:
        """Emit the held text that is final, and restart the window after it.

        First choice: the rightmost token boundary where the text does not end in U+FFFD (chunked
        pushes can hide one, e.g. 2-token chunks over 4-byte characters). Else the rightmost cut
        where decoding is additive (a run of invalid bytes).
        """
        for cut in range(len(self._ids) - 1, self._read, -1):
            left = self._decode(self._ids[:cut])
            if not left.endswith(_REPLACEMENT):
                return self._emit_through(cut, left)
        for cut in range(len(self._ids) - 1, self._read, -1):
            left = self._decode(self._ids[:cut])
            if left + self._decode(self._ids[cut:]) == text:
                return self._emit_through(cut, left)
        # Neither (not seen with UTF-8 decoders): stop holding rather than let the window grow.
        return self._emit_through(len(self._ids), text)

    def _emit_through(self, cut: int, left: str) -> str:
        """Emit `left` (the text of `_ids[:cut]`) past the context; the emitted tokens become the context."""
        out = left[len(self._context_text):]
        context = self._ids[self._read:cut]
        self._ids, self._read = context + self._ids[cut:], len(context)
        self._context_text = self._decode(context)
        return out

    def finish(self) -> str:
        """The text still held back (an incomplete or invalid tail shows as U+FFFD); call once, at the end."""
        if self._finished:
            return ""
        self._finished = True
        return self._decode(self._ids)[len(self._context_text):]
