//! `tunnel config HOST`: the options tunnel will use for HOST, resolved from
//! the ssh config exactly as for `tunnel up`, printed as `ssh -G` does.

use std::io::Write;

use crate::cli::ConfigArgs;
use crate::config::{self, show, ConfigError, LocalUser, Sources};

pub fn run(args: &ConfigArgs) -> Result<(), ConfigError> {
    let local = LocalUser::current()?;
    let sources = Sources::new(args.target.config.as_deref(), &local.home);
    let ssh_config = config::load(&sources, &local)?;
    let request = config::Request {
        jump: args
            .target
            .jump
            .as_deref()
            .map(config::parse_jump)
            .transpose()?,
        ..config::Request::default()
    };
    let target = config::resolve_with(&ssh_config, &args.target.host, &request, &local)?;
    let out = if args.json {
        format!("{:#}\n", show::json(&target))
    } else {
        show::text(&target)
    };
    // A closed stdout (`| head`) is not an error worth a message.
    let _ = std::io::stdout().lock().write_all(out.as_bytes());
    Ok(())
}
