"""Quality-versus-depth evaluation of looped models (`loopserve eval`)."""
