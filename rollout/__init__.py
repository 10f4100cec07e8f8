"""rollout: the generation half of a PPO/GRPO loop.

    from rollout import Engine, EngineConfig, SamplingParams
"""

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.request import RolloutOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "RolloutOutput", "SamplingParams"]
