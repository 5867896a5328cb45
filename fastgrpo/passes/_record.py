"""What a pass found: matched sites and near misses with their reasons.

Each pass writes into its own `PatternRecord`; the compiler collects them into the
fusion report. Counting here (like inductor's counters or AutoDeploy's `num_matches`)
is what lets tests assert that a pattern really fired.
"""
from dataclasses import dataclass, field


@dataclass
class PatternRecord:
    name: str
    sites: list[dict] = field(default_factory=list)
    near_misses: list[dict] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return len(self.sites)

    def match(self, site: str, form: str) -> None:
        self.sites.append({"site": site, "form": form})

    def miss(self, site: str, reason: str) -> None:
        self.near_misses.append({"site": site, "reason": reason})

    def as_dict(self) -> dict:
        return {
            "matched": self.matched,
            "sites": list(self.sites),
            "near_misses": list(self.near_misses),
        }
