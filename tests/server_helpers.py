"""Helpers for the server tests: a tiny word-level tokenizer with a chat template, a tiny model to match,
and a real uvicorn server on a free loopback port in a background thread."""

from __future__ import annotations

import socket
import threading
import time

WORDS = ("the a an cat dog bird fish sat ran flew swam on in under over mat tree river box and or but "
         "is was will be big small red blue green happy sad fast slow hello world python code function "
         "string list number one two three four five yes no why how what where when who . , ! ?").split()
SPECIALS = ["[UNK]", "<s>", "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word_tokenizer(words=WORDS):
    """A transformers fast tokenizer over `words` (unknown words -> [UNK]), decoding with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, tidies spaces before punctuation
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                                   additional_special_tokens=SPECIALS[2:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_target(seed: int = 0):
    """A LoadedModel: tiny random Llama whose vocabulary is the word tokenizer's."""
    from conftest import tiny_llama
    from verispec.models.loader import from_model

    tokenizer = word_tokenizer()
    model = tiny_llama(vocab=len(tokenizer), seed=seed)
    return from_model(model, tokenizer, name="tiny-words")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread, for the length of a test module."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def on_each_step(engine, before):
    """The engine, calling before() at the start of each verification step however the server drives it
    (Engine.propose is asked once per step, drafting or not): tests hold, slow down or count steps."""
    propose = engine.propose

    def hooked(*args, **kwargs):
        before()
        return propose(*args, **kwargs)

    engine.propose = hooked
    return engine
