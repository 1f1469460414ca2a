"""Vision-language conversations to training rows: the processor's tensors, labels, batches.

Loss is on assistant tokens only: for each assistant turn the processor encodes the conversation
up to the turn (with the generation prompt) and including it, and the tokens in between are
targets (the image expansion is the processor's own, so the ids are exactly what inference sees;
image tokens are never targets). Rows are one conversation each (no packing: a packed row would
need its images' positions per example). ``build_vision`` mirrors :func:`lorafuse.data.dataset.build`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lorafuse.data.dataset import DataSpec, Prepared, encode_each, split_off_eval
from lorafuse.data.formats import DataError, LoadStats
from lorafuse.data.masking import IGNORE_INDEX
from lorafuse.data.vision import VisionExample, load_image, read_vision_examples

# Per-token tensors (padded along the sequence) and per-sample image stacks (padded along images)
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")
STACKED_KEYS = ("pixel_values", "pixel_attention_mask")


@dataclass
class VisionRow:
    """One conversation's tensors (batch dimension 1), ``labels`` included."""

    tensors: dict
    truncated: bool = False
    n_examples: int = 1  # 0: a padding row

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tensors["input_ids"][0]  # (T,)

    @property
    def n_targets(self) -> int:
        return int((self.tensors["labels"] != IGNORE_INDEX).sum())

    def zeroed(self) -> VisionRow:
        """A padding row that contributes nothing: same inputs, no targets."""
        labels = torch.full_like(self.tensors["labels"], IGNORE_INDEX)
        return VisionRow({**self.tensors, "labels": labels}, n_examples=0)


def _process(processor, messages, images, add_generation_prompt=False) -> dict:
    text = processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    n = sum(p["type"] == "image" for m in messages for p in m["content"])
    # one list of images per text: what Idefics3 / SmolVLM need, and Qwen's processors accept
    kwargs = {"images": [list(images[:n])]} if n else {}
    return processor(text=[text], return_tensors="pt", **kwargs)


def prompt_inputs(processor, messages, images) -> tuple[list[int], dict]:
    """``(prompt token ids, the other tensors of its forward)`` for generation: ``messages`` in
    template form (image parts ``{"type": "image"}``) ending with a user turn."""
    enc = dict(_process(processor, messages, images, add_generation_prompt=True))
    ids = enc.pop("input_ids")[0].tolist()
    enc.pop("attention_mask", None)  # one unpadded row: all ones
    return ids, enc


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def encode_conversation(processor, messages, images, source: str,
                        train_on_inputs: bool = False) -> dict:  # fmt: skip
    """One conversation as the processor's tensors (batch of 1) plus ``labels`` on its
    assistant tokens."""
    try:
        full = _process(processor, messages, images)
        ids = full["input_ids"][0].tolist()
        labels = list(ids) if train_on_inputs else [IGNORE_INDEX] * len(ids)
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant" or train_on_inputs:
                continue
            before = _process(processor, messages[:i], images, add_generation_prompt=True)
            start = _common_prefix(before["input_ids"][0].tolist(), ids) if i else 0
            upto = ids if i == len(messages) - 1 else None
            if upto is None:
                upto = _process(processor, messages[: i + 1], images)["input_ids"][0].tolist()
            end = _common_prefix(upto, ids)
            labels[start:end] = ids[start:end]
    except Exception as err:  # jinja errors, processor checks (image token count...)
        raise DataError(f"{source}: the processor failed on this record ({err})") from None
    labels[0] = IGNORE_INDEX
    image_ids = _image_token_ids(processor)
    for k, t in enumerate(ids):  # image tokens are inputs, never targets
        if t in image_ids:
            labels[k] = IGNORE_INDEX
    row = dict(full)
    row["labels"] = torch.tensor([labels])
    return row


def _image_token_ids(processor) -> set[int]:
    tok = processor.tokenizer
    names = [getattr(processor, "image_token", None), getattr(processor, "video_token", None)]
    return {tok.convert_tokens_to_ids(n) for n in names if n} - {tok.unk_token_id, None}


def collate(rows: list[dict], pad_id: int) -> dict:
    """Right-pad token tensors (labels -100, mask 0), pad per-sample image stacks (zeros; the
    models drop all-zero images) and concatenate flat image tensors (Qwen's patches, grids)."""
    longest = max(r["input_ids"].shape[1] for r in rows)
    out = {}
    for key in sorted({k for r in rows for k in r}):
        values = [r[key] for r in rows if key in r]
        if key in TOKEN_KEYS:
            fill = {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)
            out[key] = torch.cat([
                torch.nn.functional.pad(v, (0, longest - v.shape[1]), value=fill) for v in values
            ])  # (B, T)  # fmt: skip
        elif key in STACKED_KEYS and values[0].dim() >= 4:  # (1, n_images, ...) -> (B, max, ...)
            n = max(v.shape[1] for v in values)
            like = values[0]
            stacks = []
            for r in rows:
                v = r.get(key, like[:, :0])
                pad = torch.zeros((1, n - v.shape[1], *like.shape[2:]), dtype=like.dtype)
                stacks.append(torch.cat([v, pad], dim=1))
            out[key] = torch.cat(stacks)
        else:  # (patches, dim) / (images, 3): one flat list over the batch, in row order
            out[key] = torch.cat(values)
    return out


def encode_example(ex: VisionExample, processor, spec: DataSpec, max_pixels: int):
    """Load ``ex``'s images (``file:line`` errors) and encode it."""
    images = []
    for k, ref in enumerate(ex.images):
        try:
            images.append(load_image(ref, ex.base_dir, max_pixels))
        except ValueError as err:
            raise DataError(f"{ex.source}: image {k}: {err}") from None
    tensors = encode_conversation(processor, ex.messages, images, ex.source, spec.train_on_inputs)
    return fit(tensors, processor, spec, ex.source)


def fit(row: dict, processor, spec: DataSpec, source: str) -> VisionRow | None:
    """``row`` within ``spec.max_seq_length`` as ``spec.too_long`` says (None: dropped). Text
    after the last image token may be cut; an image token never is (its features would dangle)."""
    n, limit = row["input_ids"].shape[1], spec.max_seq_length
    if n <= limit:
        return VisionRow(row)
    if spec.too_long == "drop":
        return None
    ids = row["input_ids"][0].tolist()
    image_ids = _image_token_ids(processor)
    last_image = max((k for k, t in enumerate(ids) if t in image_ids), default=-1)
    if spec.too_long == "error" or last_image >= limit:
        where = f" with image tokens up to position {last_image}" if last_image >= limit else ""
        raise DataError(
            f"{source}: record is {n} tokens{where}, longer than max_seq_length={limit} "
            "(raise max_seq_length, lower --max-pixels, or too_long=drop)"
        )
    cut = {k: v[:, :limit] if k in TOKEN_KEYS else v for k, v in row.items()}
    return VisionRow(cut, truncated=True)


def _encode_all(examples, processor, spec: DataSpec, max_pixels: int, counts) -> list[VisionRow]:
    return encode_each(examples, lambda ex: encode_example(ex, processor, spec, max_pixels),
                       spec, counts)  # fmt: skip


def build_vision(spec: DataSpec, processor, max_pixels: int) -> Prepared:
    """Read, split and encode ``spec``'s files for a vision-language model (unpacked rows)."""
    load = LoadStats()
    skip = spec.skip_bad_records
    examples = read_vision_examples(spec.train_files, skip_bad=skip, stats=load,
                                    options=spec.read_options("train"))  # fmt: skip
    random.Random(spec.seed).shuffle(examples)
    examples, eval_examples = split_off_eval(
        examples, spec, lambda files: read_vision_examples(files, skip_bad=skip, stats=load,
                                                           options=spec.read_options("eval"))
    )  # fmt: skip
    counts = {"skipped": 0, "truncated": 0, "dropped_too_long": 0, "no_targets": 0}
    train = _encode_all(examples, processor, spec, max_pixels, counts)
    evals = _encode_all(eval_examples, processor, spec, max_pixels, counts)
    if not train:
        raise DataError(f"empty dataset: no conversation with a target token in {spec.train_files}")
    stats = {"records": load.records, "bad_records_skipped": load.skipped + counts["skipped"],
             **counts, "bad_record_examples": load.skipped_examples}  # fmt: skip
    return Prepared(train, evals, len(train), len(evals), stats)
