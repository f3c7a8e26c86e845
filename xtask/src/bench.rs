//! `cargo xtask bench [kernels|attention|models|engine|serve|context-parallel|speculative]`:
//! CPU kernel, attention, model throughput, engine (prefix reuse), `te
//! serve` (concurrent streaming clients on loopback) and context-parallel
//! prefill (8192 tokens at 1, 2, 4 ranks) and speculative decoding
//! against llama.cpp (`bench_speculative`; `speculative --smoke` for a
//! short check), printed as markdown tables for docs/benchmarks.md. With
//! no argument every section but `speculative` runs.
//! `--vs-llama-cpp` runs the same-run comparison with llama.cpp instead
//! (`bench_peers`).

/// The sections, in the order they print.
const SECTIONS: [&str; 6] = [
    "kernels",
    "attention",
    "models",
    "engine",
    "serve",
    "context-parallel",
];

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if args.iter().any(|a| a == "--vs-llama-cpp") {
        return crate::bench_peers::run(args);
    }
    if args.first().is_some_and(|a| a == "speculative") {
        println!("## Speculative decoding\n");
        for row in crate::bench_speculative::run(&args[1..])? {
            println!("{row}");
        }
        return Ok(());
    }
    for a in args {
        if !SECTIONS.contains(&a.as_str()) {
            anyhow::bail!(
                "unknown bench section `{a}` (expected one of: {}, or `speculative \
                 [--precision exact|int8] [--workload NAME] [--smoke]` alone; the GPU \
                 benchmarks and parity tests run from `cargo xtask gpu-bundle`)",
                SECTIONS.join(", ")
            );
        }
    }
    let wanted = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
    if wanted("kernels") {
        println!("## CPU kernels\n");
        for row in crate::bench_kernels::run()? {
            println!("{row}");
        }
        println!("\n### Quantized matrix-vector products (decode, t = 1)\n");
        for row in crate::bench_matmul::decode_rows()? {
            println!("{row}");
        }
        println!("\n### Quantized products over several rows (batched decode, prefill)\n");
        for row in crate::bench_matmul::prefill_rows()? {
            println!("{row}");
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!(
            "\nf32 FMA peak, {threads} threads: {:.1} GFLOP/s",
            crate::bench_limits::fma_peak(threads)
        );
        if let Some(mix) = crate::bench_limits::tile_mix_peak(threads) {
            println!(
                "The same FMAs with the AVX-512 register tile's loads (10 L1-resident \
                 64-byte loads per 24 FMAs), {threads} threads: {mix:.1} GFLOP/s"
            );
        }
        println!();
    }
    if wanted("attention") {
        println!("## CPU attention\n");
        println!(
            "| case | time ms | attention | baseline | ratio | target |\n|---|---|---|---|---|---|"
        );
        for row in crate::bench_attention::run()? {
            println!("{row}");
        }
        println!();
    }
    if wanted("models") {
        crate::fetch_models::fetch(&["smollm2-135m", "gemma3-270m"])?;
        println!("## Models (tokens/s)\n");
        println!("| model | test | te-rs tok/s |\n|---|---|---|");
        for row in crate::bench_models::run(&["smollm2-135m", "gemma3-270m"])? {
            println!("{row}");
        }
        println!();
    }
    if wanted("engine") {
        crate::fetch_models::fetch(&["smollm2-135m"])?;
        println!("## Engine: prefix reuse\n");
        println!(
            "| case | prefix caching | prefill s | tokens computed | prefix hits | wall s |\n|---|---|---|---|---|---|"
        );
        for row in crate::bench_engine::run("smollm2-135m")? {
            println!("{row}");
        }
        println!();
    }
    if wanted("serve") {
        crate::fetch_models::fetch(&["smollm2-135m"])?;
        println!("## Server (te serve, smollm2-135m, streaming, 32 new tokens per request)\n");
        println!(
            "| clients | requests | requests/s | generated tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n|---|---|---|---|---|---|---|---|"
        );
        for row in crate::bench_serve::run("smollm2-135m")? {
            println!("{row}");
        }
        println!();
    }
    if wanted("context-parallel") {
        crate::fetch_models::fetch(&["gemma3-270m"])?;
        println!("## Context-parallel prefill (gemma3-270m, one 8192-token prompt)\n");
        println!(
            "| ranks | transport | prompt tokens | wall s | prefill tok/s | KV tokens per rank | KV MiB per rank |\n|---|---|---|---|---|---|---|"
        );
        for row in crate::bench_context_parallel::run()? {
            println!("{row}");
        }
    }
    Ok(())
}
