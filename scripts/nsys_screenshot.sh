#!/usr/bin/env bash
# docs/nsys-ui.png: a report from `make trace` opened in Debian's nsys-ui under Xvfb, screenshot with
# ImageMagick. Needs: apt-get install xvfb imagemagick xdotool (and make setup-nsys).
#   bash scripts/nsys_screenshot.sh results/<run>/cells/<cell>/nsys/<cell>.nsys-rep docs/nsys-ui.png
# The clicks are positions on a 1600x1000 screen: the first-run usage dialog's "No", the options
# preset "CPU Rows on Top" and "OK", then the first rank's "harness" NVTX row opened.
set -euo pipefail
report=$1; out=$2
export DISPLAY=:99
Xvfb "$DISPLAY" -screen 0 1600x1000x24 >/dev/null 2>&1 & xvfb=$!
trap 'kill $ui $xvfb 2>/dev/null || true' EXIT
sleep 2
nsys-ui "$report" >/dev/null 2>&1 & ui=$!
sleep 25; xdotool mousemove 839 446 click 1   # usage collection: No (first run only)
sleep 15; xdotool mousemove 558 450 click 1; sleep 1; xdotool mousemove 902 580 click 1  # CPU rows on top, OK
sleep 30; xdotool mousemove 374 281 click 1   # the first rank's "harness" row
sleep 4; import -window root -crop 1366x770+0+0 +repage "$out"
