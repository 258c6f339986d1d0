"""Benchmark workloads: random-length prompts, ShareGPT conversations (a file, or synthetic ones shaped like
them) and groups of prompts sharing a long system prompt.

Every prompt is English-like text sampled from a built-in word list (Zipf-weighted), so it tokenizes like
real text under any tokenizer. `prompt_len` is always measured with the tokenizer the way the server counts
(`tokenizer.encode(text)`, special tokens included).

Synthetic ShareGPT (used when `--dataset-name sharegpt` has no `--dataset-path`): conversations of one human
turn and one gpt reply whose lengths in tokens are log-normal, moment-matched to the means the vLLM paper
reports for ShareGPT (Kwon et al., SOSP 2023, Fig. 11: 161.31 input and 337.99 output tokens on average),
with spreads chosen to reproduce that figure's heavy right tails:

    prompt_tokens ~ LogNormal(mu=4.58, sigma=1.00)   median  98, mean 161
    reply_tokens  ~ LogNormal(mu=5.50, sigma=0.80)   median 245, mean 338

The usual ShareGPT filter then applies to both real and synthetic data: drop pairs whose prompt or reply
has fewer than 4 tokens, whose prompt exceeds 1024 tokens, or whose prompt + reply exceeds 2048 tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "BenchRequest",
    "DatasetError",
    "SHAREGPT_PROMPT_LOGNORMAL",
    "SHAREGPT_REPLY_LOGNORMAL",
    "TextSampler",
    "add_dataset_args",
    "get_dataset",
    "load_sharegpt_file",
    "sample_generated_shared_prefix",
    "sample_random",
    "sample_sharegpt",
    "synthetic_sharegpt_conversations",
]

DATASET_NAMES = ("random", "sharegpt", "generated-shared-prefix", "multimodal")
SHAREGPT_PROMPT_LOGNORMAL = (4.58, 1.00)  # (mu, sigma) of ln(tokens)
SHAREGPT_REPLY_LOGNORMAL = (5.50, 0.80)
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class DatasetError(ValueError):
    """A workload that cannot be built from the given arguments or file."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as the server counts them (text only when the request carries media)
    output_len: int  # max_new_tokens to ask for
    image_data: Optional[list] = None  # data URLs, one per <image> in prompt
    video_data: Optional[list] = None  # one video (a list of frame data URLs) per <video> in prompt


# ---------------------------------------------------------------------------------------------- text
_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had by
not word but what some we can out other were all there when up use your how said an each she which do their
time if will way about many then them write would like so these her long make thing see him two has look
more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year
came show every good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air well also play
small end put home read hand port large spell add even land here must big high such follow act why ask men
change went light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car feet care
second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure
watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind question
happen complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach fast
verb sing listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power town fine
certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done
beauty drive stood contain front teach week final gave green quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold possible plane stead dry
wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill east
paint language among grand ball yet wave drop heart present heavy dance engine position arm wide sail material
size vary settle speak weight general ice matter circle pair include divide syllable felt perhaps pick sudden
count square reason length represent art subject region energy hunt probable bed brother egg ride cell believe
fraction forest sit race window store summer train sleep prove lone leg exercise wall catch mount wish sky
board joy winter sat written wild instrument kept glass grass cow job edge sign visit past soft fun bright gas
weather month million bear finish happy hope flower clothe strange gone jump baby eight village meet root buy
raise solve metal whether push seven paragraph third shall held hair describe cook floor either result burn
hill safe cat century consider type law bit coast copy phrase silent tall sand soil roll temperature finger
industry value fight lie beat excite natural view sense ear else quite broke case middle kill son lake moment
scale loud spring observe child straight consonant nation dictionary milk speed method organ pay age section
dress cloud surprise quiet stone tiny climb cool design poor lot experiment bottom key iron single stick flat
twenty skin smile crease hole trade melody trip office receive row mouth exact symbol die least trouble shout
except wrote seed tone join suggest clean break lady yard rise bad blow oil blood touch grew cent mix team wire
cost lost brown wear garden equal sent choose fell fit flow fair bank collect save control decimal gentle woman
captain practice separate difficult doctor please protect noon whose locate ring character insect caught period
indicate radio spoke atom human history effect electric expect crop modern element hit student corner party
supply bone rail imagine provide agree thus capital chair danger fruit rich thick soldier process operate guess
necessary sharp wing create neighbor wash bat rather crowd corn compare poem string bell depend meat rub tube
famous dollar stream fear sight thin triangle planet hurry chief colony clock mine tie enter major fresh search
send yellow gun allow print dead spot desert suit current lift rose continue block chart hat sell success
company subtract event particular deal swim term opposite wife shoe shoulder spread arrange camp invent cotton
born determine quart nine truck noise level chance gather shop stretch throw shine property column molecule
select wrong gray repeat require broad prepare salt nose plural anger claim continent oxygen sugar death pretty
skill women season solution magnet silver thank branch match suffix especially fig afraid huge sister steel
discuss forward similar guide experience score apple bought led pitch coat mass card band rope slip win dream
evening condition feed tool total basic smell valley nor double seat arrive master track parent shore division
sheet substance favor connect post spend chord fat glad original share station dad bread charge proper bar
offer segment slave duck instant market degree populate chick dear enemy reply drink occur support speech
nature range steam motion path liquid log meant quotient teeth shell neck
""".split()
_ZIPF_OFFSET = 2.7  # flattens the head of the Zipf curve so "the" is ~6% of words, as in English prose


class TextSampler:
    """English-like text with an exact (or, rarely, near) number of tokens under `tokenizer`."""

    def __init__(self, tokenizer, rng: np.random.Generator):
        self.tokenizer = tokenizer
        self.rng = rng
        ranks = np.arange(len(_WORDS), dtype=np.float64)
        weights = 1.0 / (ranks + _ZIPF_OFFSET)
        self._probs = weights / weights.sum()
        self._n_special = len(tokenizer.encode(""))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _words(self, n_words: int) -> list[str]:
        idx = self.rng.choice(len(_WORDS), size=n_words, p=self._probs)
        words = [_WORDS[i] for i in idx]
        # sentences of 5..17 words: capitalised first word, '.', '?' or ',' at the end
        out, i = [], 0
        while i < len(words):
            n = int(self.rng.integers(5, 18))
            sent = words[i:i + n]
            sent[0] = sent[0].capitalize()
            sent[-1] += "?" if self.rng.random() < 0.1 else ("," if self.rng.random() < 0.15 else ".")
            out.extend(sent)
            i += n
        return out

    def text(self, num_tokens: int) -> str:
        """Text that encodes to `num_tokens` tokens (special tokens the tokenizer adds included)."""
        target = num_tokens - self._n_special
        if target <= 0:
            return ""
        # English BPE averages ~1.3 tokens per word: sample a little more than needed, then cut at a token
        text = " ".join(self._words(max(4, int(target / 1.1) + 4)))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < target:
            text += " " + " ".join(self._words(max(4, target - len(ids))))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        text = self.tokenizer.decode(ids[:target])
        # decoding then re-encoding can merge a token pair at the cut; pad or trim with whole words
        for _ in range(8):
            diff = self.count(text) - num_tokens
            if diff == 0:
                break
            if diff < 0:
                text += " the" * (-diff)
            else:
                text = self.tokenizer.decode(self.tokenizer.encode(text, add_special_tokens=False)[:-diff])
        return text


# ---------------------------------------------------------------------------------------------- random
def _check_positive(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise DatasetError(f"{name} must be a positive integer, got {v!r}")


def _lengths(rng: np.random.Generator, n: int, full: int, range_ratio: float) -> np.ndarray:
    lo = max(1, int(math.floor(full * range_ratio)))
    return rng.integers(lo, full + 1, size=n) if lo < full else np.full(n, full)


def sample_random(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                  seed: int = 0) -> list[BenchRequest]:
    """Prompts of uniform-random length in [input_len * range_ratio, input_len] tokens; output lengths likewise."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if not 0.0 <= range_ratio <= 1.0:
        raise DatasetError(f"range_ratio must be in [0, 1], got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    sampler = TextSampler(tokenizer, rng)
    reqs = []
    for n_in, n_out in zip(in_lens, out_lens):
        text = sampler.text(int(n_in))
        reqs.append(BenchRequest(text, sampler.count(text), int(n_out)))
    return reqs


# ---------------------------------------------------------------------------------------------- ShareGPT
def load_sharegpt_file(path: str) -> list[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DatasetError(f"ShareGPT file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of {{'conversations': [...]}} objects")
    return data


def _first_pair(conv: Any) -> Optional[tuple[str, str]]:
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    prompt, reply = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(reply, str)):
        return None
    return prompt, reply


def _sharegpt_lengths(rng: np.random.Generator, n: int, max_prompt_len: int,
                      max_total_len: int) -> list[tuple[int, int]]:
    """(prompt_tokens, reply_tokens) pairs from the log-normals, redrawn until they pass the ShareGPT filter."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        p = np.rint(rng.lognormal(*SHAREGPT_PROMPT_LOGNORMAL, size=2 * n)).astype(int)
        r = np.rint(rng.lognormal(*SHAREGPT_REPLY_LOGNORMAL, size=2 * n)).astype(int)
        ok = (p >= SHAREGPT_MIN_LEN) & (r >= SHAREGPT_MIN_LEN) & (p <= max_prompt_len) & (p + r <= max_total_len)
        out.extend(zip(p[ok].tolist(), r[ok].tolist()))
    return out[:n]


def synthetic_sharegpt_conversations(tokenizer, num: int, seed: int = 0, *,
                                     max_prompt_len: int = SHAREGPT_MAX_PROMPT_LEN,
                                     max_total_len: int = SHAREGPT_MAX_TOTAL_LEN) -> list[dict]:
    """`num` ShareGPT-format records ({"id", "conversations": [human, gpt]}) with log-normal token lengths."""
    _check_positive(num=num)
    rng = np.random.default_rng(seed)
    sampler = TextSampler(tokenizer, rng)
    convs = []
    for i, (p, r) in enumerate(_sharegpt_lengths(rng, num, max_prompt_len, max_total_len)):
        convs.append({"id": f"synthetic-{seed}-{i}", "conversations": [
            {"from": "human", "value": sampler.text(p)},
            {"from": "gpt", "value": sampler.text(r)},
        ]})
    return convs


def sample_sharegpt(tokenizer, path_or_none: Optional[str], num_prompts: int, seed: int = 0,
                    fixed_output_len: Optional[int] = None, *, max_prompt_len: int = SHAREGPT_MAX_PROMPT_LEN,
                    max_total_len: int = SHAREGPT_MAX_TOTAL_LEN) -> list[BenchRequest]:
    """First human turn as the prompt; the first gpt reply's length (or `fixed_output_len`) as the output length."""
    _check_positive(num_prompts=num_prompts)
    if fixed_output_len is not None:
        _check_positive(fixed_output_len=fixed_output_len)
    if path_or_none is None:
        convs = synthetic_sharegpt_conversations(tokenizer, num_prompts, seed, max_prompt_len=max_prompt_len,
                                                 max_total_len=max_total_len)
    else:
        convs = load_sharegpt_file(path_or_none)
        order = np.random.default_rng(seed).permutation(len(convs))
        convs = [convs[i] for i in order]
    reqs = []
    for conv in convs:
        pair = _first_pair(conv)
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        output_len = fixed_output_len if fixed_output_len is not None else reply_len
        if prompt_len < SHAREGPT_MIN_LEN or (fixed_output_len is None and output_len < SHAREGPT_MIN_LEN):
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        reqs.append(BenchRequest(prompt, prompt_len, output_len))
        if len(reqs) == num_prompts:
            break
    if not reqs:
        raise DatasetError(f"no usable conversation in {path_or_none or 'the synthetic set'} "
                           "(need a human turn then a gpt turn, within the length filter)")
    if len(reqs) < num_prompts:
        logger.warning("only %d of %d requested ShareGPT prompts pass the filter", len(reqs), num_prompts)
    return reqs


# ---------------------------------------------------------------------------------------------- shared prefix
def sample_generated_shared_prefix(tokenizer, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                   question_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num_groups` system prompts, each followed by `prompts_per_group` different questions; shuffled."""
    _check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
                    question_len=question_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    sampler = TextSampler(tokenizer, rng)
    reqs = []
    for _ in range(num_groups):
        system = sampler.text(system_prompt_len)
        for _ in range(prompts_per_group):
            prompt = system + "\n\n" + sampler.text(question_len)
            reqs.append(BenchRequest(prompt, sampler.count(prompt), output_len))
    return [reqs[i] for i in rng.permutation(len(reqs))]


# ---------------------------------------------------------------------------------------------- multimodal
def random_image_data_url(rng: np.random.Generator, width: int, height: int) -> str:
    """A JPEG data URL of smooth random colour fields plus noise (every call a different image)."""
    import base64
    import io

    from PIL import Image

    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((width, height), resample=Image.Resampling.BILINEAR), np.int16)
    img = np.clip(img + rng.integers(-12, 12, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def sample_multimodal(tokenizer, num_prompts: int, input_len: int, output_len: int, image_width: int,
                      image_height: int, images_per_prompt: int, video_frames: int, seed: int = 0) -> list[BenchRequest]:
    """Each prompt: `images_per_prompt` distinct random images (and, with video_frames > 0, one video of that many
    frames) marked <image>/<video> before `input_len` tokens of text."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len, image_width=image_width,
                    image_height=image_height)
    if images_per_prompt < 0 or video_frames < 0 or images_per_prompt + video_frames == 0:
        raise DatasetError("multimodal needs images_per_prompt > 0 or video_frames > 0 (and neither negative)")
    rng = np.random.default_rng(seed)
    sampler = TextSampler(tokenizer, rng)
    reqs = []
    for _ in range(num_prompts):
        images = [random_image_data_url(rng, image_width, image_height) for _ in range(images_per_prompt)]
        video = [random_image_data_url(rng, image_width, image_height) for _ in range(video_frames)]
        text = sampler.text(input_len)
        marks = "<image>\n" * len(images) + ("<video>\n" if video else "")
        reqs.append(BenchRequest(marks + text, sampler.count(text), output_len, image_data=images or None,
                                 video_data=[video] if video else None))
    return reqs


# ---------------------------------------------------------------------------------------------- CLI
def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="sharegpt", choices=DATASET_NAMES)
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT-format JSON file; without it, sharegpt uses synthetic conversations")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len]; 1.0 gives fixed lengths")
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--mm-image-size", default="640x480", help="multimodal: WIDTHxHEIGHT of each random image/frame")
    g.add_argument("--mm-images-per-prompt", type=int, default=1)
    g.add_argument("--mm-video-frames", type=int, default=0, help="multimodal: frames of one video per prompt (0: none)")
    g.add_argument("--seed", type=int, default=1)


def get_dataset(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    name = args.dataset_name
    seed = getattr(args, "seed", 0)
    if name == "random":
        return sample_random(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, seed)
    if name == "sharegpt":
        return sample_sharegpt(tokenizer, getattr(args, "dataset_path", None), args.num_prompts, seed,
                               getattr(args, "sharegpt_output_len", None))
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                              args.gsp_system_prompt_len, args.gsp_question_len,
                                              args.gsp_output_len, seed)
    if name == "multimodal":
        try:
            width, height = (int(v) for v in args.mm_image_size.lower().split("x"))
        except ValueError:
            raise DatasetError(f"--mm-image-size must be WIDTHxHEIGHT, got {args.mm_image_size!r}") from None
        return sample_multimodal(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, width,
                                 height, args.mm_images_per_prompt, args.mm_video_frames, seed)
    raise DatasetError(f"unknown dataset {name!r}; expected one of {', '.join(DATASET_NAMES)}")
