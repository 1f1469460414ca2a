"""`lorafuse eval`: perplexity and exact-match / contains accuracy, base vs adapters."""
