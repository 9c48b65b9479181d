"""Media in a prompt: the images and audio a multimodal projector (``--mmproj``) turns into embeddings.

A prompt with media is still one array of token ids, one entry per position: each position an
image's embeddings take holds a *stand-in* token instead of a vocabulary id. Stand-ins are
negative (vocabulary ids never are, and -1 is llama.cpp's "no token"): every position of one
image holds the same value, and admission gives each distinct image (its bytes' SHA-256) a
value of its own that no other image ever gets. So everything that compares prompts by their
tokens (the slot choice, cache reuse, the host-memory prompt cache, prefix sharing, the
replicas' routing) never takes one image's KV for another's: a common prefix stops at the
first position where the images differ. What it cannot know is that an image is decoded
whole: ``media_floor`` moves a prefix that ends inside an image back to the image's start.

``MediaChunk`` is one image (or one chunk of an audio clip: Whisper-style encoders take 30 s
each) as the task carries it: where its stand-ins are and the file it is encoded from, so the
engine (in another process, or after a restart) can encode it again. Audio is handled exactly
as images are; "image" below stands for either.
"""

from __future__ import annotations

import msgspec

NO_TOKEN = -1  # llama.cpp's LLAMA_TOKEN_NULL; stand-ins are below it


class MediaChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One image's span of a task's prompt: positions ``[pos, pos + n_pos)`` hold its stand-in."""

    pos: int
    n_pos: int  # prompt positions it takes (its embeddings, except for M-RoPE models)
    n_tokens: int  # embeddings it decodes into the KV
    data: bytes  # the file (png, jpeg, ...; wav, mp3, flac) the embeddings are encoded from
    part: int = 0  # which media chunk of that file (sliced images, audio over 30 s make several)

    @property
    def end(self) -> int:
        return self.pos + self.n_pos


def is_standin(token: int) -> bool:
    return token < NO_TOKEN
