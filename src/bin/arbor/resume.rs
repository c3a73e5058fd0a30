//! What every training run does before its first step: claim its checkpoint folder and resume
//! from `--resume`.

use crate::args::TrainArgs;
use arbor::checkpoint::Checkpoint;
use arbor::run_folder::{Existing, RunFolder};
use arbor::trainer::{AutoBatch, Learned, Next, Run, Settings};
use arbor::{Error, Result};
use std::path::{Path, PathBuf};

/// Where `--resume DIR` resumes from and the run folder it belongs to: `DIR/last` in the run
/// folder `DIR`, or `DIR` itself, a checkpoint whose run folder is its parent when it is a
/// `last/` (none otherwise: a checkpoint copied out of its run).
fn resume_source(dir: &Path) -> (PathBuf, Option<PathBuf>) {
    if dir.join("last").is_dir() {
        return (dir.join("last"), Some(dir.to_path_buf()));
    }
    let parent = dir.parent().filter(|_| dir.file_name().is_some_and(|n| n == "last")).map(|p| {
        if p.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            p.to_path_buf()
        }
    });
    (dir.to_path_buf(), parent)
}

/// The folder a run writes its checkpoints to: `--checkpoint`, or else the run folder that
/// `--resume` continues (so a resumed run keeps saving where it was saving).
pub(crate) fn checkpoint_dir(args: &TrainArgs) -> Option<PathBuf> {
    args.checkpoint.clone().or_else(|| args.resume.as_deref().and_then(|dir| resume_source(dir).1))
}

/// The automatic batch size's settings (its step-time model among them) that the checkpoint
/// `--resume` continues recorded, if any: the resumed run goes on with them, untimed.
pub(crate) fn resumed_batch_settings(args: &TrainArgs) -> Option<AutoBatch> {
    let (dir, _) = resume_source(args.resume.as_deref()?);
    AutoBatch::recorded(&Checkpoint::meta(&dir).ok()?)
}

/// Whether `a` and `b` name the same folder (compared as canonical paths where they exist).
fn same_folder(a: &Path, b: &Path) -> bool {
    let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    canonical(a) == canonical(b)
}

/// This process's rank in an MPI job as the launcher tells it (0 outside one); only rank 0
/// writes checkpoints, so only rank 0 claims the folder.
fn launcher_rank() -> usize {
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}

/// What every run does before its first step: claims its checkpoint folder
/// ([`checkpoint_dir`]; locked for the run's whole life, refused when another run writes there
/// or its checkpoints belong to another run and neither `--resume` of them nor `--overwrite`
/// says what to do), and resumes from `--resume` (its `last/`), refusing a checkpoint that has
/// nothing left to train. The returned claim must be kept until the run ends.
pub(crate) fn prepare_run<L: Learned>(
    runs: &mut [Run<L>],
    args: &TrainArgs,
    plan: &Settings,
) -> Result<Option<RunFolder>> {
    let resume = args.resume.as_deref().map(resume_source);
    if args.overwrite && args.checkpoint.is_none() {
        return Err(Error::input("--overwrite", "a --checkpoint DIR whose checkpoints to replace", "no --checkpoint"));
    }
    let resumes_here = |dir: &Path| resume.as_ref().and_then(|r| r.1.as_deref()).is_some_and(|r| same_folder(r, dir));
    if let Some(dir) = plan.checkpoint.as_deref().filter(|d| args.overwrite && resumes_here(d)) {
        return Err(Error::input(
            "--overwrite",
            "a --checkpoint folder other than the one --resume continues",
            format!("both {}", dir.display()),
        ));
    }
    // Everything that may refuse the resume comes before the folder is claimed, so a refused run
    // changes nothing on disk.
    let mut resumed = None;
    if let Some((from, run_folder)) = &resume {
        if !from.join("meta.json").exists() {
            return Err(Error::input(
                format!("--resume {}", args.resume.as_deref().unwrap_or(from).display()),
                "a folder holding a complete checkpoint (a run's folder or its `last/`)",
                "none there (a run stopped before its first checkpoint was written has nothing to resume)",
            ));
        }
        if let Some(best) = run_folder.as_ref().map(|f| f.join("best")).filter(|b| b.exists()) {
            // The best epoch so far must load too: a resumed run would keep a corrupted one.
            Checkpoint::load(&best)?;
        }
        let ck = Checkpoint::load(from)?;
        // Every worker's run (a pipeline's stages each take their part) resumes from it.
        for run in runs.iter_mut() {
            run.resume(&ck, &plan.meta)?;
        }
        let run = runs.first().ok_or_else(|| Error::input("a run", "at least one worker", "none"))?;
        let stopped = |hook: &arbor::trainer::EpochHook| run.last_epoch().is_some_and(|e| hook(&e) == Next::Stop);
        let done = run.position().epoch > plan.epochs
            || plan.max_steps.is_some_and(|m| run.position().steps >= m)
            || (run.position().step_in_epoch == 0 && plan.on_epoch.as_ref().is_some_and(stopped));
        if done {
            return Err(Error::input(
                format!("--resume {}", from.display()),
                "a checkpoint with training left to do (raise --epochs, --max-steps or --patience)",
                format!(
                    "one at epoch {}, step {} (--epochs {})",
                    run.position().epoch,
                    run.position().steps,
                    plan.epochs
                ),
            ));
        }
        if run_folder.is_none() && args.checkpoint.is_none() {
            return Err(Error::input(
                format!("--resume {}", from.display()),
                "a --checkpoint DIR to keep writing to (the checkpoint is not the `last/` of a run folder)",
                "no --checkpoint",
            ));
        }
        resumed = Some(ck.meta["tensors_file"].clone());
    }
    let folder = match &plan.checkpoint {
        Some(dir) if args.distributed.is_none() || launcher_rank() == 0 => {
            let existing = match (args.overwrite, resumes_here(dir)) {
                (true, _) => Existing::Overwrite,
                (false, true) => Existing::Resume,
                (false, false) => Existing::Refuse,
            };
            Some(RunFolder::claim(dir, existing)?)
        }
        _ => None,
    };
    if let (Some((from, _)), Some(file)) = (&resume, resumed) {
        // A run that held the folder until this one claimed it may have saved once more.
        let now = Checkpoint::tensors_path(from)?;
        if now.file_name().and_then(|n| n.to_str()) != file.as_str() {
            return Err(Error::input(
                format!("--resume {}", from.display()),
                "a checkpoint that stays as it was while this run starts",
                "one that another run replaced meanwhile (start this run again)",
            ));
        }
        if let Some(run) = runs.first() {
            eprintln!(
                "arbor: resuming from {} at epoch {}, step {}",
                from.display(),
                run.position().epoch,
                run.position().steps
            );
        }
    }
    Ok(folder)
}
