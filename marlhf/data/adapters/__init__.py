"""Dataset adapters behind ``--data_path``: hub names, their local copies, plain files, the synthetic task.

See :mod:`marlhf.data.adapters.loader` for the spec grammar and :mod:`marlhf.data.adapters.rows` for the
per-dataset row -> Record functions.
"""

from marlhf.data.adapters.loader import (
    ADAPTERS,
    SYNTHETIC_TEST_SEED_OFFSET,
    Adapter,
    DatasetUnavailableError,
    available_datasets,
    dataset_name,
    dropped_summary,
    load_records,
    parse_spec,
    parse_synthetic_options,
)
from marlhf.data.adapters.rows import (
    DroppedRow,
    anthropic_hh_row,
    apps_prompt,
    apps_row,
    dahoas_row,
    generic_row,
    split_last_assistant_turn,
    strip_citations,
    summarize_row,
    tldr_prompt,
    webgpt_row,
)

__all__ = [
    "ADAPTERS",
    "SYNTHETIC_TEST_SEED_OFFSET",
    "Adapter",
    "DatasetUnavailableError",
    "DroppedRow",
    "anthropic_hh_row",
    "apps_prompt",
    "apps_row",
    "available_datasets",
    "dataset_name",
    "dahoas_row",
    "dropped_summary",
    "generic_row",
    "load_records",
    "parse_spec",
    "parse_synthetic_options",
    "split_last_assistant_turn",
    "strip_citations",
    "summarize_row",
    "tldr_prompt",
    "webgpt_row",
]
