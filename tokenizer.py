# One small interface over the three tokenizer kinds LLaMA-family checkpoints ship with
# (sentencepiece, Llama-3 tiktoken, HF tokenizer.json), plus chat templates as plain string formatting.
import base64
import functools
import itertools
import json
import re
from pathlib import Path
from typing import Optional, Protocol

import gguf
import sentencepiece as spm
import tiktoken
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from errors import UsageError, one_line


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: Optional[int]
    eos_id: Optional[int]

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Special-token texts inside `text` become their ids (special=False: they stay text); never adds BOS."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def special_id(self, text: str) -> Optional[int]: ...


class SentencePieceTokenizer:
    def __init__(self, path: Path):
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.specials = {
            self.sp.id_to_piece(i): i
            for i in range(self.vocab_size)
            if self.sp.is_control(i) or self.sp.is_unknown(i)
        }
        self.special_texts = {i: piece for piece, i in self.specials.items()}
        # sentencepiece reads "<s>" in text as the characters '<', 's', '>', so specials are split out first
        longest_first = sorted(self.specials, key=len, reverse=True)
        self.special_pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def encode(self, text: str, special: bool = True) -> list[int]:
        if not special:
            return self.sp.encode(text)
        ids = []
        for part in self.special_pattern.split(text):
            if part in self.specials:
                ids.append(self.specials[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        parts = []
        for is_special, group in itertools.groupby(ids, key=self.special_texts.__contains__):
            group = list(group)
            parts.append("".join(self.special_texts[i] for i in group) if is_special else self.sp.decode(group))
        return "".join(parts)

    def special_id(self, text: str) -> Optional[int]:
        return self.specials.get(text)


# Meta's Llama-3 tokenizer: split pattern and the 256 special tokens that follow the base ranks, in Meta's order
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
]


class TiktokenTokenizer:
    def __init__(self, path: Path):
        ranks = {}
        for line in path.read_text().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        self.specials = {text: len(ranks) + i for i, text in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(
            path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self.specials
        )
        self.vocab_size = self.enc.n_vocab
        self.bos_id = self.specials["<|begin_of_text|>"]
        self.eos_id = self.specials["<|end_of_text|>"]

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.enc.encode(text, allowed_special="all") if special else self.enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def special_id(self, text: str) -> Optional[int]:
        return self.specials.get(text)


class HFTokenizer:
    def __init__(self, path: Path):
        self.tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.specials = {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        # tokenizer.json does not say which token is BOS/EOS; tokenizer_config.json next to it does
        config_path = path.parent / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except ValueError as e:
            raise ValueError(f"{config_path} is not JSON ({one_line(e, 80)})") from None
        self.bos_id = self._config_token_id(config.get("bos_token"))
        self.eos_id = self._config_token_id(config.get("eos_token"))

    def _config_token_id(self, value) -> Optional[int]:
        text = value.get("content") if isinstance(value, dict) else value
        return self.tok.token_to_id(text) if text else None

    @functools.cached_property
    def literal(self) -> tokenizers.Tokenizer:
        """A copy that reads special-token texts as text (its own object: a flag flipped on the shared one would race)."""
        tok = tokenizers.Tokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode(self, text: str, special: bool = True) -> list[int]:
        return (self.tok if special else self.literal).encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def special_id(self, text: str) -> Optional[int]:
        return self.specials.get(text)


def _is_tiktoken_file(path: Path) -> bool:
    # Llama-3 ships "base64 rank" text lines under the name sentencepiece uses for its binary protobuf
    with open(path, "rb") as f:
        return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\s*", f.readline()) is not None


def load_tokenizer(checkpoint_dir) -> Tokenizer:
    """Raises FileNotFoundError without a tokenizer file, and a one-line ValueError naming the file that does not load
    (the three libraries fail each in their own way: tokenizers with a bare Exception)."""
    checkpoint_dir = Path(checkpoint_dir)
    model_path, json_path = checkpoint_dir / "tokenizer.model", checkpoint_dir / "tokenizer.json"
    path = model_path if model_path.is_file() else json_path
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.model or tokenizer.json in {checkpoint_dir}")
    try:
        if path == json_path:
            return HFTokenizer(json_path)
        return TiktokenTokenizer(model_path) if _is_tiktoken_file(model_path) else SentencePieceTokenizer(model_path)
    except Exception as e:
        raise ValueError(f"{path} is not a tokenizer eaglet can read ({one_line(e, 120)})") from None


# llama.cpp pre-tokenizer names whose rule we know; any other name gets the plain GPT-2 ByteLevel regex.
# Digit-split: every \p{N} alone, then the GPT-2 regex. Llama-3: its own regex, a pre-token found whole in the
# vocab skips the merges, and BOS is added by default.
DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
GGUF_CONTROL_TOKEN = 3


@functools.lru_cache(maxsize=1)
def _gguf_tokenizer_fields(gguf_path: str) -> dict:
    # GGUFReader parses the whole file (seconds), so both public readers share one parse
    reader = gguf.GGUFReader(gguf_path)
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def _gguf_pre_tokenizer(pre: str):
    if pre in LLAMA3_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def tokenizer_json_from_gguf(gguf_path) -> str:
    fields = _gguf_tokenizer_fields(str(gguf_path))
    model = fields["tokenizer.ggml.model"]
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
    tokens = fields["tokenizer.ggml.tokens"]
    pre = fields.get("tokenizer.ggml.pre", "default")
    tok = tokenizers.Tokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]],
        ignore_merges=pre in LLAMA3_PRES,
    ))
    tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == GGUF_CONTROL_TOKEN
    ])
    return tok.to_str()


def gguf_tokenizer_facts(gguf_path) -> dict:
    fields = _gguf_tokenizer_fields(str(gguf_path))
    # llama.cpp's default when the key is absent: BOS for sentencepiece vocabularies and the Llama-3 pre-tokenizers
    default_add_bos = fields["tokenizer.ggml.model"] != "gpt2" or fields.get("tokenizer.ggml.pre") in LLAMA3_PRES
    return {
        "bos_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_id": fields.get("tokenizer.ggml.eos_token_id"),
        "add_bos": fields.get("tokenizer.ggml.add_bos_token", default_add_bos),
        "chat_template": fields.get("tokenizer.chat_template"),
    }


SMOLLM_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
VICUNA_SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


class Marker(str):
    """A chat template's own special-token text (<|im_start|>, <|eot_id|>, </s>): encode_prompt reads it as that token,
    where the same characters inside a message stay characters."""


# Each template -> the prompt as a list of parts: the messages' text, the template's text and its Markers.
def _format_plain(messages: list[dict], add_generation_prompt: bool) -> list:
    return [m["content"] for m in messages]


def _format_chatml(messages: list[dict], add_generation_prompt: bool, default_system: str = "") -> list:
    if default_system and messages and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": default_system}, *messages]
    start, end = Marker("<|im_start|>"), Marker("<|im_end|>")
    parts = [part for m in messages for part in (start, f"{m['role']}\n", m["content"], end, "\n")]
    return parts + ([start, "assistant\n"] if add_generation_prompt else [])


def _format_llama3(messages: list[dict], add_generation_prompt: bool) -> list:
    # Meta's reference strips each message's content
    start, end, eot = Marker("<|start_header_id|>"), Marker("<|end_header_id|>"), Marker("<|eot_id|>")
    parts = [part for m in messages for part in (start, m["role"], end, f"\n\n{m['content'].strip()}", eot)]
    return parts + ([start, "assistant", end, "\n\n"] if add_generation_prompt else [])


def _format_llama2(messages: list[dict], add_generation_prompt: bool) -> list:
    # Meta's chat_completion: the system block joins the first user turn; each answered turn ends with </s> and the
    # next opens with <s> (the caller adds the first BOS). The open [INST] turn is already the generation prompt.
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = f"<<SYS>>\n{messages[0]['content']}\n<</SYS>>\n\n", messages[1:]
    parts = []
    for m in messages:
        if m["role"] == "user":
            parts += ([Marker("<s>")] if parts else []) + [f"[INST] {(system + m['content']).strip()} [/INST]"]
            system = ""
        else:
            parts += [f" {m['content'].strip()} ", Marker("</s>")]
    return parts


def _format_vicuna(messages: list[dict], add_generation_prompt: bool) -> list:
    # FastChat's vicuna_v1.1: a user turn ends with " ", an assistant turn with "</s>"
    system = VICUNA_SYSTEM_PROMPT
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    parts = [system + " "]
    for m in messages:
        parts += [f"USER: {m['content']} "] if m["role"] == "user" else [f"ASSISTANT: {m['content']}", Marker("</s>")]
    return parts + (["ASSISTANT:"] if add_generation_prompt else [])


CHAT_FORMATTERS = {
    "": _format_plain,
    "none": _format_plain,
    "chatml": _format_chatml,
    "smollm": functools.partial(_format_chatml, default_system=SMOLLM_SYSTEM_PROMPT),
    "llama3": _format_llama3,
    "llama2": _format_llama2,
    "vicuna": _format_vicuna,
}

CHAT_STOP_STRINGS: dict[str, list[str]] = {
    "": [],
    "none": [],
    "chatml": ["<|im_end|>", "<|endoftext|>"],
    "smollm": ["<|im_end|>", "<|endoftext|>"],
    "llama3": ["<|eot_id|>", "<|end_of_text|>"],
    "llama2": ["</s>"],
    "vicuna": ["</s>"],
}


def chat_parts(family: str, messages: list[dict], add_generation_prompt: bool = True) -> list:
    """The prompt for `messages` ([{"role": ..., "content": ...}]) as parts: text, and Markers where the template
    puts its special tokens. Without BOS."""
    if family not in CHAT_FORMATTERS:
        raise ValueError(f"unknown chat family {family!r}, expected one of {sorted(CHAT_FORMATTERS)}")
    return CHAT_FORMATTERS[family](messages, add_generation_prompt)


def format_chat(family: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}]), without BOS."""
    return "".join(chat_parts(family, messages, add_generation_prompt))


def check_text(text: str, what: str) -> str:
    """text, if it is valid Unicode to tokenize. A lone surrogate comes from a JSON escape such as \\ud800, or stands for
    a byte that is not UTF-8 (Python reads such command-line bytes as U+DC80..U+DCFF): the tokenizers refuse both."""
    bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if bad is None:
        return text
    c = ord(text[bad])
    if 0xDC80 <= c <= 0xDCFF:
        raise UsageError(f"{what}: byte 0x{c - 0xDC00:02x} at character {bad} is not UTF-8")
    raise UsageError(f"{what}: a lone surrogate U+{c:04X} at character {bad} is not Unicode text")


def check_messages(messages) -> list:
    """messages, if they are a conversation to tokenize: a list of {"role": str, "content": str}, every string Unicode."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UsageError(f"messages must be a list of {{\"role\": ..., \"content\": ...}} objects, got {messages!r:.60}")
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise UsageError(f"message {i + 1}'s {key} must be a string, got {m.get(key)!r:.60}")
            check_text(m[key], f"message {i + 1}'s {key}")
    return messages


def encode_prompt(tokenizer: Tokenizer, args, messages: list[dict], chat: bool = True) -> list[int]:
    """Token ids of a conversation for a model (args: its ModelArgs): BOS where the model wants one, then the chat
    template around the messages. Only the template's own markers are special tokens: the messages are text, whatever
    they hold (a user's "<|im_end|>" stays those characters and cannot end their turn). chat=False: the messages' text
    as it is, a prompt its caller wrote whole, whose special-token texts are read as their tokens. UsageError for
    messages that are not a conversation of Unicode text."""
    check_messages(messages)
    ids = [args.bos_token] if args.bos_token is not None else []
    if not chat:
        return ids + tokenizer.encode(format_chat("", messages))
    text = ""  # the text since the last special token
    for part in chat_parts(args.chat_template, messages):
        special = tokenizer.special_id(part) if isinstance(part, Marker) else None
        if special is None:
            text += part
            continue
        ids += (tokenizer.encode(text, special=False) if text else []) + [special]
        text = ""
    return ids + (tokenizer.encode(text, special=False) if text else [])


def detect_chat_family(chat_template: Optional[str], name: str = "") -> str:
    template = chat_template or ""
    if "<|im_start|>" in template:
        return "smollm" if "SmolLM" in template else "chatml"
    if "<|start_header_id|>" in template:
        return "llama3"
    if "[INST]" in template:
        return "llama2"
    name = name.lower()
    if "vicuna" in name:
        return "vicuna"
    if "llama-2" in name and "chat" in name:
        return "llama2"
    if "llama-3" in name and "instruct" in name:
        return "llama3"
    return ""


class StreamDecoder:
    """A generation's ids in, its text out as it grows, decoding a few tokens at a time (never the whole answer again):
    each push decodes from the token before the last text it returned, so that a word's leading space and a character
    split across byte tokens come out as the whole answer's decode would give them."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids, self.prefix, self.read = [], 0, 0  # ids[prefix:read] decoded already: the context of the next piece

    def push(self, new_ids: list) -> str:
        """The text the new ids add (a multi-byte character split across byte tokens waits for its last byte)."""
        self.ids += new_ids
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the answer, as the whole decode gives it)."""
        before, text = self.tokenizer.decode(self.ids[self.prefix:self.read]), self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]