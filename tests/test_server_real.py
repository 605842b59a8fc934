"""verispec serve on the real embedded SmolLM2-135M: its chat template and byte-level BPE through the
server, streamed text and per-token pieces against the library's own output."""

from __future__ import annotations

import openai
import pytest

from server_helpers import ServerThread
from verispec.api import generate
from verispec.server import ServerConfig, create_app

CHAT = [{"role": "user", "content": "List the numbers from one to five, separated by commas."}]


@pytest.mark.real_model
def test_smollm2_chat_through_the_server(smollm2):
    with ServerThread(create_app(smollm2, ServerConfig(method="ngram", draft_length=4))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        ref = generate(smollm2, chat=CHAT, method="ngram", draft_length=4, max_new_tokens=12)
        full = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=12, temperature=0)
        assert full.choices[0].message.content == ref.text
        assert full.usage.prompt_tokens == len(smollm2.encode(chat=CHAT))
        chunks = list(client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=12,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
        pieces = [p for c in chunks for p in (c.model_extra.get("verispec") or {}).get("pieces", [])]
        assert len(pieces) == len(ref.token_ids)
        assert "".join(pieces) == smollm2.decode(ref.token_ids)  # pieces tile the text, spaces included
