#!/bin/bash
# Worker of tests/launch/test_torch_run.py run with --no-python (torch's bin/test_script.sh).
FILE="$1/$RANK"
echo "creating $FILE"
touch "$FILE"
