"""The record of what built a run (`run.json`): `jaxlearn.checkpoint.run_record`, which
owns its format, lookup and the run directory's tokenizer copy, so that readers of a run's
model (`jaxlearn.interop.open_model`) need neither the trainer nor its config's shape. The
trainer writes it through these names."""

from jaxlearn.checkpoint.run_record import (
    RECORD_FILE,
    TOKENIZER_DIR,
    RunRecord,
    RunRecordError,
    find_run_record,
    run_tokenizer_path,
    save_tokenizer,
)

__all__ = ["RECORD_FILE", "TOKENIZER_DIR", "RunRecord", "RunRecordError", "find_run_record",
           "run_tokenizer_path", "save_tokenizer"]
