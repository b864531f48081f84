"""The committed writeup is what the report code makes of the committed results: a change to the report code that
alters the published writeup fails here until the writeup is re-rendered and committed with it."""

from __future__ import annotations

import re

from cs336_systems.report import render

from ..conftest import REPO

RUN = "gpu"


def test_published_writeup_re_renders_byte_for_byte(tmp_path):
    rendered = render(RUN, REPO / "results" / RUN, tmp_path)  # figures go to tmp_path/figures
    published = (REPO / "report" / RUN / "writeup.md").read_text()
    assert rendered == published, f"re-render report/{RUN}/writeup.md and commit it with the report change"
    # Figures are not compared byte for byte (matplotlib versions differ), but every one linked must exist.
    links = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", rendered)
    assert links
    for link in links:
        assert (tmp_path / link).is_file(), link
        assert (REPO / "report" / RUN / link).is_file(), link
