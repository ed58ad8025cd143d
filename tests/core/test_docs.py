"""The docs stay true to the tree: the config reference matches the code's fields and defaults, and
every relative link in README.md and docs/ points at a file that exists."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_config_reference_matches_the_code():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "config_table.py"), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
