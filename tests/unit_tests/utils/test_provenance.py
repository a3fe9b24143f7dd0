"""A measurement's record of when, on what and from which code it was taken."""

import json

from megatron.bridge.utils import provenance


def test_provenance_names_the_machine_and_the_code():
    record = provenance.collect()
    assert record.cpu.endswith("logical CPUs") and record.date[:4].isdigit() and record.commit
    assert set(record.packages) == set(provenance.PACKAGES)
    assert provenance.Provenance.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert provenance.git_commit(tmp_path) == "unknown"


def test_the_machine_line_says_when_there_is_no_gpu():
    record = provenance.collect()
    fake = provenance.Provenance(**{**record.to_json(), "gpu": "none", "cpu": "X x 2 logical CPUs", "ram": "1.0 GiB"})
    assert fake.machine() == "X x 2 logical CPUs, 1.0 GiB, no GPU"
