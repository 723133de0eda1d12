# SPDX-License-Identifier: Apache-2.0
"""The tiny models' tokenizer: a byte-level BPE trained on a deterministic built-in corpus, with a ChatML template.

The corpus does not depend on the model seed or the architecture, so every
tiny model has the same tokenizer.
"""

from __future__ import annotations

import random

from kvpush.dev.tinymodel.architectures import QWEN3_CONFIG

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 4096

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is that it for was on are as with by be at this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth need far hand "
    "high year mother light parts country father let night following picture being study second eyes soon "
    "times story boys since white days ever paper hard near sentence better best across during today others "
    "however sure means knew try told young miles sun ways thing whole hear example heard several change answer "
    "room sea against top turned learn point city play toward five using himself usually cache prefill decode "
    "engine transfer block tensor request latency token worker scheduler router broker registrar stream write"
).split()
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "ch",
           "cl", "dr", "gr", "pl", "qu", "sh", "st", "th", "tr", "str"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "ee", "oo"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "x", "rk"]
_PUNCT = [".", ",", ";", ":", "!", "?"]


def corpus(num_sentences: int = 6000) -> list[str]:
    """The deterministic tokenizer training corpus.

    Sentences of common English words mixed with pseudo-words built from
    syllables, numbers and punctuation, drawn with a fixed `random.Random`.
    The corpus does not depend on the model seed, so the tokenizer is the
    same for every seed.
    """
    rng = random.Random(20240607)
    pseudo = sorted({
        "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        for _ in range(3000)
    } - {""})
    lines = []
    for _ in range(num_sentences):
        words = []
        for _ in range(rng.randint(6, 18)):
            roll = rng.random()
            if roll < 0.6:
                words.append(rng.choice(_WORDS))
            elif roll < 0.92:
                # Zipf-like: early pseudo-words are much more frequent.
                words.append(pseudo[min(int(rng.paretovariate(1.0)) - 1, len(pseudo) - 1)
                                    if rng.random() < 0.5 else rng.randrange(len(pseudo))])
            else:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
        text = " ".join(words)
        lines.append(text[0].upper() + text[1:] + rng.choice(_PUNCT))
    return lines


def build_tokenizer():
    """Trains the byte-level BPE tokenizer; returns a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=QWEN3_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
