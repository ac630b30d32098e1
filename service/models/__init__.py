"""Model versions: their config and files, the checks and stages that build them, the pipeline that
runs them, the repository that holds them."""
