"""The text tracker's windowed decoding: the same text and the same streamed pieces as decoding every id at
every step, at a cost that does not grow with the output's length."""

from __future__ import annotations

import random

import pytest

from verispec.output import TextTracker

# a byte-level vocabulary (as byte-level BPE tokenizers decode): ids 0-255 are single bytes, the rest pieces
# of text, some of them multi-byte characters and parts of them
PIECES = [bytes([b]) for b in range(256)] + [s.encode() for s in ("the", " cat", " sat", ".", "\n", " é", "ü", " STOP", "ST", "OP")] + [
    "日本".encode()[:4], "日本".encode()[4:], "🙂".encode()[:2], "🙂".encode()[2:]]


def byte_decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def spaced_decode(ids: list[int]) -> str:  # joins pieces with spaces: decoding two sides apart loses one
    return " ".join(str(i) for i in ids)


def run(tracker: TextTracker, ids: list[int], rng: random.Random) -> tuple[list[str], str, list[int]]:
    """Feed ids in random step sizes -> (streamed pieces, final text, the id counts each decode call got)."""
    seen, real = [], tracker.decode

    def counting(x):
        seen.append(len(x))
        return real(x)

    tracker.decode = counting
    pieces, n = [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 6))
        pieces.append(tracker.update(ids[:n], final=n == len(ids)))
        if tracker.stopped:
            break
    return pieces, tracker.text, seen


def reference(decode, stop: tuple[str, ...]) -> TextTracker:
    return TextTracker(decode, stop, windowed=False)  # never moves the cut: every step decodes every id


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stop", [(), (" STOP",), ("cat sat", "\n\n")])
def test_windowed_text_equals_decoding_everything(seed, stop):
    rng = random.Random(seed)
    whole = [[256 + i] for i in range(10)] + [[266, 267], [268, 269]] + [[b] for b in range(32, 127)]
    ids = []
    while len(ids) < 600:  # text as a model writes it: whole characters, now and then a stray byte or half
        r = rng.random()  # characters split over two ids (the cut may fall between them), whole pieces, stray bytes
        ids += rng.choice([[266, 267], [268, 269]]) if r < 0.3 else rng.choice(whole) if r < 0.98 else [rng.choice([0xC3, 0xE6, 266, 268])]
    got = run(TextTracker(byte_decode, stop), ids, random.Random(seed))
    want = run(reference(byte_decode, stop), ids, random.Random(seed))
    assert got[0] == want[0] and got[1] == want[1]
    assert "".join(got[0]) == got[1]
    # a step decodes a window's worth of ids (a cut that cannot move waits one window more), not the output
    assert max(got[2]) <= 5 * TextTracker.WINDOW
    if not stop:
        assert got[1] == byte_decode(ids) and max(want[2]) == len(ids) > 5 * TextTracker.WINDOW


def test_the_cut_stays_where_decoding_apart_would_change_the_text():
    rng = random.Random(0)
    ids = [rng.randrange(1000) for _ in range(300)]
    t = TextTracker(spaced_decode, ())
    got = run(t, ids, random.Random(1))
    assert t.cut == 0 and got[1] == spaced_decode(ids)
    assert got[0] == run(reference(spaced_decode, ()), ids, random.Random(1))[0]
