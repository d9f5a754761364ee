"""One switch for transformers' chatter in commands: errors only, no progress bars."""


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
