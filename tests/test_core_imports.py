"""``import mixprec`` (and everything the lab imports) never imports the optional integrations' packages."""

import subprocess
import sys


def test_core_and_lab_import_no_transformers_lightning_or_accelerate():
    code = ("import sys, mixprec, mixprec.lab.cli, mixprec.integrations, mixprec.integrations.logging;"
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate', 'timm', 'torchvision') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
