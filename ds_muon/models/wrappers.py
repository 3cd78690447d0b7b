"""The module behind a model wrapper, so what ds_muon decides about a model cannot depend on the wrapper."""

from __future__ import annotations

_MAX_DEPTH = 6


# what each wrapper keeps its module under: DDP / DataParallel / DeepSpeed's engine / FSDP1's root
# (``module``), torch.compile's OptimizedModule (``_orig_mod``), PEFT's PeftModel (``base_model.model``
# through ``get_base_model()``)
_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine",
                    "FullyShardedDataParallel", "OptimizedModule", "PeftModel", "PeftModelForCausalLM",
                    "PeftModelForSequenceClassification", "PeftModelForSeq2SeqLM", "PeftModelForTokenClassification",
                    "PeftModelForQuestionAnswering", "PeftModelForFeatureExtraction", "PeftMixedModel")


def unwrap_model(model):
    """The user's module behind DDP, DataParallel, DeepSpeed's engine, an FSDP1 root, ``torch.compile`` and
    PEFT (FSDP2's ``fully_shard`` and accelerate keep the module itself, or wrap it in one of these), so what
    is decided about a model cannot depend on how it is wrapped.  Parameters are the same objects."""
    for _ in range(_MAX_DEPTH):
        name = type(model).__name__
        inner = None
        if name == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        elif name.startswith("PeftModel") or name == "PeftMixedModel":
            get = getattr(model, "get_base_model", None)
            inner = get() if callable(get) else None
        elif name in _MODULE_WRAPPERS:
            inner = getattr(model, "module", None)
        if inner is None or inner is model:
            return model
        model = inner
    return model
