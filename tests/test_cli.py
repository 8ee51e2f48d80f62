import subprocess
import sys


def test_generate_prints_a_coherent_answer(default_model_dir):
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "What is the capital of France?",
                          "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_generate_reports_bad_input():
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "hi", "--model", "/no/such/dir"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--max-tokens" in out.stdout
