"""Local lm-evaluation-harness tasks for the tests: rows written as a JSON-lines dataset and a
task YAML beside it, so that lm-eval downloads nothing."""

from __future__ import annotations

import json
from pathlib import Path

MULTIPLE_CHOICE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def task_manager(folder: Path, name: str, template: str, rows: list[dict]):
    """An lm-eval TaskManager that knows task `name`: `template` (formatted with the task's name and
    its data file) over `rows`, both written into `folder`."""
    from lm_eval.tasks import TaskManager

    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(template.format(name=name, data=data))
    return TaskManager(include_path=str(folder))
