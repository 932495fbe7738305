"""Golden bundles: the reference's inputs and outputs recorded once, replayed later without torch.

A bundle folder holds golden.json (format, versions, the artifact's config,
dtype and file hashes, the settings, the tolerance overrides the recording
was judged with, the call list, the sha256 of arrays.npz and one of what
golden.json records) and arrays.npz. A replay judges with the recorded
overrides (see tolerances.parity.AppliedOverrides). The hashes tie the two files
together: a save interrupted between them, or a stored value or id edited
since, reads as a damaged bundle, never as a numeric failure of the artifact.

- bundle: the folder's two files and their format version, GoldenMismatch, and what ties a bundle to its artifact
  (its identity) and its two files together (the recording's digest);
- recording: RecordedReference, which records a live reference's calls or replays a bundle's;
- writing: save_bundle, a recording written as a bundle (an older one there replaced whole or kept whole), and
  check_golden_destination, the folder golden_save may write into;
- reading: load_bundle, a bundle read and checked against its artifact, handed back as a GoldenBundle to replay.
"""
