/// Calls `on_interrupt` at every SIGINT: a client with interrupt_mode "signal" interrupts
/// the kernel that way instead of with an interrupt_request.
pub fn spawn_on_sigint(on_interrupt: impl Fn() + Send + 'static) {
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut sigint) = signal(SignalKind::interrupt()) else {
            tracing::warn!("SIGINT cannot be watched: interrupts come by interrupt_request only");
            return;
        };
        while sigint.recv().await.is_some() {
            on_interrupt();
        }
    });
}
