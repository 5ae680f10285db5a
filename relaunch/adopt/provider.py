"""Which provider's instance this is, from what the scan saw (its user, its files, its metadata).
"""

from __future__ import annotations

import re

from .facts import Scan


def guess_provider(scan: Scan, user: str) -> tuple[str, str]:
    vendor = " ".join(v for v in (scan.dmi.get("sys_vendor", ""), scan.dmi.get("product_name", ""),
                                  scan.dmi.get("bios_vendor", "")) if v)
    rules = [("aws", r"Amazon EC2|^Amazon"), ("gcp", r"Google"), ("azure", r"Microsoft Corporation.*Virtual Machine")]
    for provider, pattern in rules:
        if re.search(pattern, vendor):
            return provider, f"/sys/class/dmi/id says {vendor!r}"
    env = set(scan.login_env)
    for provider, names in (("runpod", ("RUNPOD_POD_ID", "RUNPOD_API_KEY")), ("vast", ("VAST_CONTAINERLABEL",)),
                            ("paperspace", ("PAPERSPACE_FQDN", "PAPERSPACE_METRIC_WORKLOAD_ID"))):
        hit = env & set(names)
        if hit:
            return provider, f"{sorted(hit)[0]} is set in a login's environment"
    if user in ("paperspace", "Ubuntu"):
        return {"paperspace": "paperspace", "Ubuntu": "massedcompute"}[user], f"the login user is {user}"
    seen = f"/sys/class/dmi/id says {vendor!r}" if vendor else "no vendor in /sys/class/dmi/id"
    return "", f"{seen}, no provider's variables in a login's environment"
