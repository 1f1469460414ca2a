"""EVA init (PEFT's ``init_lora_weights="eva"``): each LoRA ``A`` from the right singular
vectors of its layer's inputs on the training data, ranks redistributed by explained variance
(``EvaConfig.rho``), through PEFT's own ``initialize_lora_eva_weights``.

Where the data comes from: the training set's rows in their stored order, collated exactly as
training micro-batches are (``batch_size`` rows; packed rows carry ``position_ids``), fed through
the adapted model without labels and without gradients (only the hooked layers' inputs matter).
PEFT's SVD takes the target tokens only (``labels != -100``, its ``use_label_mask``) and cycles
through these batches until every layer's components have converged. It collects the inputs
with the adapters disabled, so the patched attention/MLP fast paths call each projection module
itself and its forward hook fires (the q_proj check in tests/train/test_eva_train.py). Every
rank of a distributed run reads the same rows, so no inputs are gathered across ranks and each
computes the same init.
"""

from __future__ import annotations

import torch

from lorafuse.data.packing import Row, collate
from lorafuse.errors import LorafuseError

# Rows read for the SVD at most: PEFT cycles over them until convergence, so a few hundred rows
# of up to max_seq_length tokens are enough for ranks up to 64 (IncrementalPCA needs each batch
# to hold at least r·rho target tokens; it raises otherwise).
MAX_ROWS = 256


def eva_batches(rows: list[Row], pad_id: int, packed: bool, batch_size: int, device) -> list:
    """Model-input dicts (labels included, for the mask) over the first :data:`MAX_ROWS` rows."""
    rows = rows[:MAX_ROWS]
    out = []
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad_id, packed)
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


def _forward(model, inputs):
    # no labels: the forward only has to reach the hooked layers (no loss, no gradient)
    return model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)


def initialize(model, rows: list[Row], pad_id: int, packed: bool, batch_size: int, device) -> None:
    """Run PEFT's EVA init on ``model`` (a PeftModel created with ``init_lora_weights="eva"``)."""
    from peft.tuners.lora import initialize_lora_eva_weights

    batches = eva_batches(rows, pad_id, packed, batch_size, device)
    if not batches:
        raise LorafuseError("init_lora_weights=eva: no training rows to compute the SVD from")
    was_training = model.training
    model.eval()  # no dropout in the SVD's inputs
    try:
        with torch.no_grad():
            initialize_lora_eva_weights(
                model, dataloader=batches, forward_fn=_forward, gather_distributed_inputs=False,
                show_progress_bar=False,
            )  # fmt: skip
    except ValueError as err:  # e.g. a batch with fewer target tokens than r·rho components
        raise LorafuseError(f"init_lora_weights=eva: {err}") from None
    finally:
        model.train(was_training)
