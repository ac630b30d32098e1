"""The search index model kind: a packed corpus ranked by Hamming or Tanimoto."""
