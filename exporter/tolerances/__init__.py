"""Tolerances: what an output may differ by. The export's own checks and the verification judge by the same
profiles, so this layer sits below both. Data and numpy: no torch.

- parity: Tolerance, the parity profiles per dtype and provider (profile_for), the user's overrides
- quality: the quality profiles of int4/int8 artifacts (quality_profile_for), a quality target's thresholds
"""
